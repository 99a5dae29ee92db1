"""No secret in any output: log records, reprs of options/profiles/stores, URL errors."""

from __future__ import annotations

import io
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cloudckpt import errors
from cloudckpt.cli.main import main
from cloudckpt.options import TransferOptions, resolve_options
from cloudckpt.profiles import load_profiles
from cloudckpt.redact import (
    MASK,
    RedactingFilter,
    display_url,
    is_secret_name,
    mask_options,
    redact_text,
)
from cloudckpt.store import open_target, split_url

SECRET = "SECRETMARK"

# (text holding SECRET, text that must survive next to it)
PATTERNS = [
    pytest.param(
        f"Authorization: AWS4-HMAC-SHA256 Credential=AKID/20240101/us-east-1/s3/aws4_request, "
        f"SignedHeaders=host;x-amz-date, Signature={SECRET}\nx-amz-date: 20240101T000000Z",
        "x-amz-date: 20240101T000000Z",
        id="authorization-header-line",
    ),
    pytest.param(
        f"CanonicalRequest:\nGET\n/b/k\n\nhost:127.0.0.1\nx-amz-security-token:{SECRET}\n\nhost",
        "host:127.0.0.1",
        id="canonical-request-token",
    ),
    pytest.param(
        f"Signature:\n{SECRET}",
        "Signature:",
        id="botocore-signature-line",
    ),
    pytest.param(
        f"headers={{'X-Amz-Date': b'20240101', 'X-Amz-Security-Token': b'{SECRET}', "
        f"'Authorization': b'AWS4-HMAC-SHA256 Credential=AKID, Signature={SECRET}'}}",
        "'X-Amz-Date': b'20240101'",
        id="botocore-headers-repr",
    ),
    pytest.param(
        f"GET /b/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential={SECRET}%2F2024"
        f"&X-Amz-Date=20240101&X-Amz-Signature={SECRET}",
        "X-Amz-Date=20240101",
        id="s3-presigned-query",
    ),
    pytest.param(
        f"https://acct.blob.core.windows.net/c/b?sv=2022-11-02&sp=r&sig={SECRET}%2Fx%3D",
        "sv=2022-11-02&sp=r",
        id="azure-sas-query",
    ),
    pytest.param(
        f"GET https://storage.googleapis.com/b/o?X-Goog-Algorithm=GOOG4-RSA-SHA256"
        f"&X-Goog-Credential={SECRET}&X-Goog-Signature={SECRET}",
        "X-Goog-Algorithm=GOOG4-RSA-SHA256",
        id="gcs-signed-query",
    ),
    pytest.param(
        f"{{'Authorization': 'Bearer {SECRET}', 'x-goog-api-client': 'gl-python'}}",
        "'x-goog-api-client': 'gl-python'",
        id="bearer-in-headers",
    ),
    pytest.param(f"sent Bearer {SECRET} upstream", "upstream", id="bare-bearer"),
    pytest.param(
        f"x-ms-version: 2021\nAuthorization: SharedKey acct:{SECRET}",
        "x-ms-version: 2021",
        id="azure-sharedkey",
    ),
    pytest.param(
        f"DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={SECRET}==;"
        "BlobEndpoint=http://127.0.0.1:10000/acct;",
        "AccountName=acct",
        id="connection-string-account-key",
    ),
    pytest.param(
        f"BlobEndpoint=https://acct.blob.core.windows.net;SharedAccessSignature=sv=2022&{SECRET}=1;",
        "BlobEndpoint=https://acct.blob.core.windows.net",
        id="connection-string-sas",
    ),
    pytest.param(
        f"S3Store(aws_secret_access_key='{SECRET}', region_name='us-east-1')",
        "region_name='us-east-1'",
        id="kwargs-repr",
    ),
    pytest.param(
        f"AWS_SESSION_TOKEN={SECRET} AWS_REGION=eu-west-1",
        "AWS_REGION=eu-west-1",
        id="env-assignment",
    ),
    pytest.param(
        f'{{"access_token": "{SECRET}", "expires_in": 3599}}',
        '"expires_in": 3599',
        id="json-token",
    ),
    pytest.param(
        f"<Credentials><AccessKeyId>ASIA</AccessKeyId><SecretAccessKey>{SECRET}</SecretAccessKey>"
        f"<SessionToken>{SECRET}</SessionToken><Expiration>2030</Expiration></Credentials>",
        "<Expiration>2030</Expiration>",
        id="sts-xml",
    ),
    pytest.param(
        f"connect to http://minio:{SECRET}@127.0.0.1:9000/bucket",
        "127.0.0.1:9000/bucket",
        id="url-userinfo",
    ),
    pytest.param(
        f"-----BEGIN PRIVATE KEY-----\n{SECRET}\n-----END PRIVATE KEY-----",
        "BEGIN PRIVATE KEY",
        id="pem-private-key",
    ),
    pytest.param(
        f"{{'password': '{SECRET}', 'client_secret': '{SECRET}', 'api_key': '{SECRET}'}}",
        "'password': '***'",
        id="secret-named-keys",
    ),
]


@pytest.mark.parametrize(("text", "kept"), PATTERNS)
def test_redact_text_masks_each_pattern(text: str, kept: str) -> None:
    shown = redact_text(text)
    assert SECRET not in shown, shown
    assert MASK in shown
    assert kept in shown, shown


@pytest.mark.parametrize(
    "text",
    [
        "read s3://bucket/run1/step-000000100/state.pt (3 requests)",
        "{'Bucket': 'b', 'Key': 'run/x.pt', 'Range': 'bytes=0-7'}",
        "ObjectInfo(key='run/x.pt', size=3, etag='abc')",
        "endpoint_url='http://127.0.0.1:9000', region_name='us-east-1'",
        'http://127.0.0.1:9000 "GET /b/k?uploadId=7&partNumber=2 HTTP/1.1" 200 5',
        "retrying read s3://b/k in 0.20s (attempt 2): ThrottledError",
    ],
)
def test_redact_text_leaves_ordinary_text_alone(text: str) -> None:
    assert redact_text(text) == text


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("aws_secret_access_key", True),
        ("aws_session_token", True),
        ("aws_access_key_id", True),
        ("secret", True),
        ("token", True),
        ("password", True),
        ("sas_token", True),
        ("account_key", True),
        ("AccountKey", True),
        ("connection_string", True),
        ("AZURE_STORAGE_CONNECTION_STRING", True),
        ("credential", True),
        ("credentials", True),
        ("credentials_file", True),
        ("client_secret", True),
        ("private_key", True),
        ("X-Amz-Security-Token", True),
        ("X-Amz-Signature", True),
        ("X-Goog-Credential", True),
        ("sig", True),
        ("Authorization", True),
        ("key", False),
        ("Key", False),
        ("endpoint_url", False),
        ("region_name", False),
        ("profile_name", False),
        ("account_name", False),
        ("account_url", False),
        ("anonymous", False),
        ("addressing_style", False),
        ("SignedHeaders", False),
    ],
)
def test_secret_name_rule(name: str, secret: bool) -> None:
    assert is_secret_name(name) is secret


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (f"az://c/k.pt?sv=2022&se=2030&sig={SECRET}", "az://c/k.pt"),
        (f"s3://b/k.pt?X-Amz-Signature={SECRET}#frag", "s3://b/k.pt"),
        (f"s3://user:{SECRET}@b/k.pt", "s3://b/k.pt"),
        (f"https://acct.blob.core.windows.net/c?{SECRET}", "https://acct.blob.core.windows.net/c"),
        (
            f"abfs://c@acct.dfs.core.windows.net/k?sig={SECRET}",
            "abfs://c@acct.dfs.core.windows.net/k",
        ),
        ("gs:///key", "gs:///key"),
        ("file:///tmp/x.pt", "file:///tmp/x.pt"),
        ("/tmp/run?1/x.pt", "/tmp/run?1/x.pt"),  # a plain path: '?' is a character
    ],
)
def test_display_url(url: str, shown: str) -> None:
    assert display_url(url) == shown


def test_mask_options_keeps_keys_and_non_secrets() -> None:
    shown = mask_options(
        {
            "endpoint_url": f"http://minio:{SECRET}@127.0.0.1:9000",
            "region_name": "us-east-1",
            "aws_access_key_id": SECRET,
            "aws_secret_access_key": SECRET,
            "aws_session_token": SECRET,
            "account_url": f"https://acct.blob.core.windows.net?sv=1&sig={SECRET}",
            "anonymous": False,
            "nested": {"client_secret": SECRET, "project": "p"},
            "sas_token": None,
        }
    )
    assert SECRET not in repr(shown)
    assert shown["region_name"] == "us-east-1" and shown["anonymous"] is False
    assert shown["endpoint_url"] == f"http://minio:{MASK}@127.0.0.1:9000"
    assert shown["aws_secret_access_key"] == MASK and shown["nested"]["project"] == "p"
    assert shown["sas_token"] is None  # nothing set is nothing to hide


SECRET_OPTIONS = {
    "endpoint_url": "http://127.0.0.1:9000",
    "region_name": "eu-west-1",
    "aws_access_key_id": "AKID" + SECRET,
    "aws_secret_access_key": SECRET,
    "aws_session_token": SECRET,
}


def test_transfer_options_repr_masks_storage_options() -> None:
    options = TransferOptions(part_size=8 << 20, storage_options=SECRET_OPTIONS)
    for text in (repr(options), str(options), repr(options.replace(write_concurrency=3))):
        assert SECRET not in text, text
        assert "http://127.0.0.1:9000" in text and "eu-west-1" in text
        assert "part_size=8388608" in text and "aws_session_token" in text
    assert options.storage_options["aws_session_token"] == SECRET  # only the display changes


@pytest.fixture
def profile_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = tmp_path / "config.toml"
    path.write_text(
        "[profiles.lab]\n"
        'url = "s3://lab-bucket"\n'
        "[profiles.lab.storage_options]\n"
        'endpoint_url = "http://127.0.0.1:9000"\n'
        f'aws_secret_access_key = "{SECRET}"\n'
        f'aws_session_token = "{SECRET}"\n'
    )
    monkeypatch.setenv("CLOUDCKPT_CONFIG", str(path))
    yield path


def test_profile_repr_masks_secrets(profile_file: Path) -> None:
    profile = load_profiles()["lab"]
    assert SECRET not in repr(profile) and SECRET not in str(profile)
    assert "s3://lab-bucket" in repr(profile) and "http://127.0.0.1:9000" in repr(profile)
    resolved = resolve_options(url="profile://lab/run/x.pt")
    assert resolved.storage_options["aws_session_token"] == SECRET
    assert SECRET not in repr(resolved)


def test_store_and_target_reprs_show_no_secret() -> None:
    target = open_target("s3://repr-bucket/run/x.pt", storage_options=SECRET_OPTIONS)
    for text in (repr(target), str(target), repr(target.store), str(target.store)):
        assert SECRET not in text, text
    assert repr(target.store) == "S3Store('s3://repr-bucket')"
    assert "repr-bucket" in repr(target) and "eu-west-1" in repr(target)


def test_azure_store_repr_hides_the_connection_string() -> None:
    pytest.importorskip("azure.storage.blob")
    from cloudckpt.store.azure import AzureStore

    conn = (
        "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;"
        f"AccountKey={SECRET}==;BlobEndpoint=http://127.0.0.1:1/devstoreaccount1;"
    )
    store = AzureStore("ctr", {"connection_string": conn})
    assert repr(store) == "AzureStore('az://ctr')"
    options = TransferOptions(storage_options={"connection_string": conn})
    assert SECRET not in repr(options) and "connection_string" in repr(options)


@pytest.mark.parametrize(
    "url",
    [
        f"az://ctr/run/x.pt?sv=2022-11-02&se=2030-01-01&sp=r&sig={SECRET}",
        f"azure://ctr/x.pt?sig={SECRET}",
        f"gs://bkt/x.pt?X-Goog-Signature={SECRET}",
        f"s3://bkt/x.pt?X-Amz-Security-Token={SECRET}",
        f"abfs://ctr@acct.dfs.core.windows.net/x.pt?sig={SECRET}",
        f"gopher://user:{SECRET}@host/x.pt?sig={SECRET}",
        f"s3:///x.pt?sig={SECRET}",
        f"file://host:{SECRET}@elsewhere/x.pt",
    ],
)
def test_invalid_url_errors_do_not_echo_secrets(url: str) -> None:
    with pytest.raises(errors.InvalidURLError) as info:
        split_url(url)
    assert SECRET not in str(info.value), str(info.value)


def test_unknown_profile_error_does_not_echo_a_query(profile_file: Path) -> None:
    with pytest.raises(errors.InvalidURLError, match="no profile named 'nope'") as info:
        split_url(f"profile://nope/x.pt?sig={SECRET}")
    assert SECRET not in str(info.value)


def _capture(logger: logging.Logger) -> tuple[io.StringIO, logging.Handler]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    return stream, handler


def test_filter_on_a_handler_redacts_any_logger_args_and_tracebacks() -> None:
    logger = logging.getLogger("botocore.test_secrets")
    stream, handler = _capture(logger)
    handler.addFilter(RedactingFilter())
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        logger.debug("CanonicalRequest:\n%s", f"host:h\nx-amz-security-token:{SECRET}\n")
        logger.debug("headers=%r", {"Authorization": f"Bearer {SECRET}", "Range": "bytes=0-1"})
        try:
            raise ValueError(f"bad connection string AccountKey={SECRET};")
        except ValueError:
            logger.exception("failed for %s", f"az://c/k?sig={SECRET}")
        logger.debug("a %s record", "plain")
    finally:
        logger.removeHandler(handler)
    out = stream.getvalue()
    assert SECRET not in out, out
    assert "x-amz-security-token:***" in out and "'Range': 'bytes=0-1'" in out
    assert "ValueError" in out and "a plain record" in out


def test_records_with_nothing_to_mask_keep_their_args() -> None:
    record = logging.LogRecord(
        "cloudckpt", logging.INFO, __file__, 1, "read %s", ("s3://b/k",), None
    )
    RedactingFilter().filter(record)
    assert record.args == ("s3://b/k",) and record.getMessage() == "read s3://b/k"


def test_library_logger_never_carries_a_secret(caplog: pytest.LogCaptureFixture) -> None:
    """Records of cloudckpt's own logger are masked before any handler sees them."""
    caplog.set_level(logging.DEBUG, logger="cloudckpt")
    logging.getLogger("cloudckpt").debug("options %r", {"aws_secret_access_key": SECRET})
    assert caplog.records and SECRET not in caplog.text


def test_verbose_cli_filters_every_root_handler(monkeypatch: pytest.MonkeyPatch) -> None:
    """``-v`` puts the filter on the handlers the SDKs' records reach (the root's)."""
    root = logging.getLogger()
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    monkeypatch.setattr(root, "handlers", [handler])
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    level = root.level
    try:
        assert main(["latest", "-v", "-v", "/nonexistent-cloudckpt-run"]) == 3
        logging.getLogger("urllib3.connectionpool").debug("GET /c/b?sv=1&sig=%s", SECRET)
    finally:
        root.setLevel(level)
    assert any(isinstance(f, RedactingFilter) for f in handler.filters)
    assert "sig=***" in stream.getvalue() and SECRET not in stream.getvalue()


def test_a_malformed_record_is_still_masked() -> None:
    record = logging.LogRecord(
        "x", logging.INFO, __file__, 1, "%s and %s", (f"sig={SECRET}",), None
    )
    RedactingFilter().filter(record)
    assert SECRET not in record.getMessage()
