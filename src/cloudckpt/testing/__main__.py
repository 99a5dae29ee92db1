"""``python -m cloudckpt.testing moto|rclone|gcs|azure``: one local server, until killed."""

import sys

from ._cli import main

sys.exit(main())
