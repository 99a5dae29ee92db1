"""The restricted pickle machine: the one place cloudckpt turns stored pickles into objects.

:class:`RestrictedUnpickler` is a pickle machine of our own (a dispatch over opcodes, in
the manner of torch's ``torch/_weights_only_unpickler.py``) that runs under a
:class:`Policy`:

* only the opcodes the policy lists (at least torch's weights-only set); any other is
  refused, and a byte that is no opcode at all is damage;
* a global only if the policy's allow-list names it (``GLOBAL``, ``STACK_GLOBAL``);
* a constructor (``REDUCE``, ``NEWOBJ``) only on an allowed callable, with a tuple of
  arguments, never with a plain integer size for a tensor, storage or ``bytearray``
  (the legacy size constructors that allocate what the file asks);
* ``BUILD``, ``APPEND(S)``, ``SETITEM(S)`` and ``ADDITEMS`` only on objects this load
  built, tracked by identity (:attr:`RestrictedUnpickler._own`: the ids of the
  containers its opcodes made and of what a call known to make a new object returned;
  every other object reaching the stack takes its id out), of the kinds
  torch allows (lists, dicts, sets, tensors, parameters, instances of allowed classes):
  never on a global the pickle named, a storage ``persistent_load`` supplied, or an
  object an allowed call returned that may be shared (an enum member, a cached value);
* a tensor's ``set_`` (``BUILD``'s legacy form, on a tensor or a parameter) only over a
  storage, inside it;
* a persistent id only of the form ``('storage', ...)``;
* memory in proportion to the file: the memo is a dict, strings and byte strings are
  cut from the file's own bytes, and nothing is kept across loads.

:func:`run_restricted` runs it: what the policy refuses raises
:class:`~cloudckpt.errors.UnsafeCheckpointError`; bytes that are not a valid pickle
(damage, truncation, a constructor that fails on its arguments)
:class:`~cloudckpt.errors.CorruptCheckpointError`. The policies: torch's weights-only
one (format/torch/unpickle.py), DCP ``.metadata``'s (format/dcp/metadata.py) and the DCP
layout parse's (format/dcp/archive.py). docs/security.md says what this promises and
how ``tests/security`` proves it against torch's own unpickler.
"""

from __future__ import annotations

import codecs
import math
import pickle
import pickletools
import struct
import types
from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import CloudCkptError, CorruptCheckpointError, UnsafeCheckpointError

__all__ = [
    "MAX_TUPLE_DEPTH",
    "PROTOCOL4_OPCODES",
    "TORCH_OPCODES",
    "Policy",
    "Refused",
    "RestrictedUnpickler",
    "as_text",
    "check_extent",
    "check_materialised",
    "check_tensor_state",
    "contiguous_strides",
    "run_restricted",
    "short",
    "sparse_queue",
    "validate_sparse",
]


def as_text(value: Any) -> str | None:
    """A pickle's text field, which Python 2 pickles wrote as bytes; None for anything
    else (bytes that are not ASCII included). Never ``str(value)``: a field holding a
    storage of a million elements would be formatted element by element (100 MiB and
    seconds, from a few bytes of pickle)."""
    if type(value) is str:
        return value
    if type(value) is bytes:
        try:
            return value.decode("ascii")
        except UnicodeDecodeError:
            return None
    return None


#: How deep tuples may nest in a pickle (torch.save's nest a few levels; CPython crashes
#: hashing one nested about 150,000 deep on an 8 MiB stack).
MAX_TUPLE_DEPTH = 1000


class Refused(UnsafeCheckpointError):
    """Content the policy does not allow (raised inside the machine, named at the top)."""


def _o(name: str) -> int:
    return pickle.__dict__[name][0]


#: The opcodes torch's weights-only unpickler runs (protocol 2, as torch.save writes).
TORCH_OPCODES = frozenset(
    _o(n)
    for n in [
        "GLOBAL",
        "NEWOBJ",
        "REDUCE",
        "BUILD",
        "APPEND",
        "APPENDS",
        "SETITEM",
        "SETITEMS",
        "MARK",
        "TUPLE",
        "TUPLE1",
        "TUPLE2",
        "TUPLE3",
        "NONE",
        "NEWFALSE",
        "NEWTRUE",
        "EMPTY_TUPLE",
        "EMPTY_LIST",
        "EMPTY_DICT",
        "EMPTY_SET",
        "BININT",
        "BININT1",
        "BININT2",
        "BINFLOAT",
        "BINUNICODE",
        "SHORT_BINSTRING",
        "BINPERSID",
        "BINGET",
        "LONG_BINGET",
        "BINPUT",
        "LONG_BINPUT",
        "LONG1",
        "PROTO",
        "STOP",
    ]
)
#: What ``pickle.dumps`` adds in protocols 3 to 5 (DCP's ``.metadata`` is written so).
PROTOCOL4_OPCODES = TORCH_OPCODES | frozenset(
    _o(n)
    for n in [
        "FRAME",
        "SHORT_BINUNICODE",
        "BINUNICODE8",
        "MEMOIZE",
        "STACK_GLOBAL",
        "SHORT_BINBYTES",
        "BINBYTES",
        "BINBYTES8",
        "ADDITEMS",
        "FROZENSET",
        "POP",
        "POP_MARK",
        "DUP",
    ]
)


@dataclass(frozen=True)
class Policy:
    """What one kind of pickle may contain.

    ``globals``: ``"module.name"`` -> the object that name decodes to (nothing else is
    importable). ``opcodes``: the opcodes allowed, at least torch's (the machine tests
    only the others). ``refuse_global(module, name)``: the error for a name outside
    ``globals``. ``map_python2_names``: map Python 2 names as torch's unpickler does.
    ``advice``: what a refusal's message ends with. ``calls``: what runs when the pickle
    calls one of ``globals`` (by the global's ``id``), where that is not the global
    itself (a checked or faster version of it); the pickle still gets the global
    itself wherever it names it as a value. ``encoding``: how a Python 2 string is
    decoded (``torch.load``'s utf-8, or ``pickle.load``'s ascii)."""

    globals: Mapping[str, Any]
    opcodes: frozenset[int] = TORCH_OPCODES
    refuse_global: Callable[[str, str], Exception] | None = None
    map_python2_names: bool = True
    #: Said after a refusal: what a user who trusts the file can do.
    advice: str = (
        "If you trust this file, pass weights_only=False; to allow a specific class, use "
        "torch.serialization.add_safe_globals([...])."
    )

    calls: Mapping[int, Callable[..., Any]] = field(default_factory=dict)
    #: How a Python 2 ``str`` (``SHORT_BINSTRING``) is decoded: as ``torch.load`` decodes
    #: it (utf-8), or as ``pickle.load`` does (ascii: what DCP's own reader runs).
    encoding: str = "utf-8"

    def __post_init__(self) -> None:
        if not self.opcodes >= TORCH_OPCODES:
            raise ValueError("a policy admits at least torch's weights-only opcodes")


_SETITEM_TYPES = (dict, OrderedDict, Counter)
_STORAGES = (torch.storage.TypedStorage, torch.UntypedStorage)
_unpack_i = struct.Struct("<i").unpack_from
_unpack_H = struct.Struct("<H").unpack_from
_unpack_I = struct.Struct("<I").unpack_from
_unpack_Q = struct.Struct("<Q").unpack_from
_unpack_d = struct.Struct(">d").unpack_from
_WIDTH = {4: _unpack_I, 8: _unpack_Q}
#: Protocol 3-5 opcodes of a length and bytes: (the length's width, whether text).
_SIZED = {0x8C: (1, True), 0x8D: (8, True), 0x43: (1, False), 0x42: (4, False), 0x8E: (8, False)}


class RestrictedUnpickler:
    """Unpickles ``data`` under ``policy``; ``persistent_load`` supplies storages.

    One load per instance. The object graph is built exactly as the C unpickler and
    torch's unpickler build it, so what both accept loads equal; everything outside
    the policy raises :class:`UnsafeCheckpointError`, everything malformed
    :class:`CorruptCheckpointError` (by :func:`run_restricted`)."""

    def __init__(
        self,
        data: bytes | bytearray | memoryview,
        policy: Policy,
        persistent_load: Callable[[Any], Any] | None = None,
        *,
        encoding: str | None = None,
        settle: Callable[[], None] | None = None,
    ) -> None:
        self.data = bytes(data) if not isinstance(data, bytes) else data
        self.policy = policy
        self.persistent_load = persistent_load
        self.encoding = policy.encoding if encoding is None else encoding
        #: Called once before the first call that may read or write tensor memory (see
        #: :data:`_TOUCH_FREE`): the storages' bytes are still being read until then.
        self._settle = settle
        #: The ids of the objects this load built: the only objects a mutator (BUILD,
        #: APPEND(S), SETITEM(S), ADDITEMS) may change. Ids, not the objects: holding
        #: them would keep what the pickle dropped (a set made and dropped a million
        #: times). An id outlives its object, so every object that reaches the stack
        #: from anywhere else (a global, a storage, a call that may return a shared
        #: object) has its id taken out: a live object's id is its own, so an entry
        #: left by a dead object at the same address is gone before any mutator looks.
        self._own: set[int] = set()
        #: How deep each tuple the tuple opcodes built from tuples nests (by id, as
        #: ``_own``: an entry a dead tuple left can only overstate a new one's depth).
        self._depths: dict[int, int] = {}
        self._callables = {id(v) for v in policy.globals.values() if callable(v)}
        #: Allowed callables whose every call makes a new object (:func:`_makes_new`).
        self._fresh = {id(v) for v in policy.globals.values() if _makes_new(v)}
        #: Allowed classes NEWOBJ may make and BUILD fill with a dict inline: new objects
        #: (``object.__new__``), no ``__setstate__``, none of the kinds checked further.
        self._plain = {
            id(v)
            for v in policy.globals.values()
            if _new_makes_new(v)
            and v not in _INT_SIZED_CLASSES
            and v not in _SPARSE_CLASSES
            and v not in _SETITEM_TYPES
            and getattr(v, "__setstate__", None) is None
        }
        #: What a call of each allowed callable runs (its override, else itself).
        self._runs = {id(v): policy.calls.get(id(v), v) for v in policy.globals.values()}
        self._classes = {id(v) for v in policy.globals.values() if isinstance(v, type)}

    # The globals a pickle names, mapped as torch maps Python 2 names.
    def find_class(self, module: str, name: str) -> Any:
        policy = self.policy
        if policy.map_python2_names:
            if (module, name) in NAME_MAPPING:
                module, name = NAME_MAPPING[(module, name)]
            elif module in IMPORT_MAPPING:
                module = IMPORT_MAPPING[module]
        full_path = f"{module}.{name}"
        globals_ = policy.globals
        if full_path in globals_:
            return globals_[full_path]
        if policy.refuse_global is not None:
            raise policy.refuse_global(module, name)
        raise Refused(f"the pickle names {full_path}, which this kind of file never holds")

    def _call(self, func: Any, args: Any, op: str) -> Any:
        """``func(*args)`` for REDUCE, after the policy's checks; a new object it made is
        this load's own."""
        if id(func) not in self._callables:
            raise Refused(f"{op} of {_describe(func)}, which is not an allowed callable")
        if type(args) is not tuple:
            raise Refused(f"{op} of {_describe(func)} with {type(args).__name__} arguments")
        _check_constructor(func, args, op)
        if self._settle is not None and id(func) not in _TOUCH_FREE_IDS:
            self._settled()
        if func is _rebuild_from_type_v2:
            return self._from_type_v2(*args)
        if func in _DEVICE_REBUILDS:  # (data, dtype, device, requires_grad)
            data = args[0] if args else None
            if id(data) not in self._own:
                raise Refused(f"{_describe(func)} of {_describe(data)}, not one this load built")
            check_materialised(data, args[1] if len(args) > 1 else None)
        elif func is _rebuild_parameter_with_state and len(args) == 4:
            check_tensor_state(torch.nn.Parameter, args[3])
        result = self._runs[id(func)](*args)
        if func in _SPARSE_CLASSES:  # validated after the load, as torch does
            sparse_queue().append(result)
        if id(func) in self._fresh:
            self._own.add(id(result))
        else:
            self._own.discard(id(result))
        return result

    def _from_type_v2(
        self, func: Any = None, new_type: Any = None, args: Any = None, state: Any = None, *x: Any
    ) -> Any:
        """``torch._tensor._rebuild_from_type_v2`` (a tensor subclass, or a tensor with
        attributes): ``func(*args)`` as a REDUCE, made ``new_type``, its state set, as
        torch's does; the state only on a new object this load made."""
        if x or id(new_type) not in self._classes:
            raise Refused("_rebuild_from_type_v2 of a type that is not allowed")
        ret = self._call(func, args, "_rebuild_from_type_v2")
        if type(ret) is not new_type:
            ret = ret.as_subclass(new_type)  # a new tensor object (torch refuses others)
            self._own.add(id(ret))
        custom = getattr(type(ret), "__setstate__", _tensor_setstate) is not _tensor_setstate
        if (state or custom) and id(ret) not in self._own:
            raise Refused(
                f"_rebuild_from_type_v2 sets the state of {_describe(ret)}, which this load "
                "did not build"
            )
        if custom:
            self._settled()  # a __setstate__ of its own may read the tensor
            ret.__setstate__(state)
            return ret
        if isinstance(ret, torch.Tensor):
            check_tensor_state(type(ret), state)
        return torch._utils._set_obj_state(ret, state)

    def _newobj(self, cls: Any, args: Any) -> Any:
        if cls is torch.nn.Parameter:
            if type(args) is not tuple:
                raise Refused(f"NEWOBJ of Parameter with {type(args).__name__} arguments")
            result = torch.nn.Parameter(*args)
            self._own.add(id(result))
            return result
        if id(cls) not in self._classes:
            raise Refused(f"NEWOBJ of {_describe(cls)}, which is not an allowed class")
        if type(args) is not tuple:
            raise Refused(f"NEWOBJ of {_describe(cls)} with {type(args).__name__} arguments")
        _check_constructor(cls, args, "NEWOBJ")
        if self._settle is not None and id(cls) not in _TOUCH_FREE_IDS:
            self._settled()
        result = cls.__new__(cls, *args)
        if cls in _SPARSE_CLASSES:
            sparse_queue().append(result)
        if _new_makes_new(cls):
            self._own.add(id(result))
        else:
            self._own.discard(id(result))
        return result

    def _settled(self) -> None:
        """Wait, once, until every storage's bytes are in and checked."""
        settle, self._settle = self._settle, None
        if settle is not None:
            settle()

    def _is_own(self, value: Any) -> bool:
        """Whether ``value`` is an object this load built (the mutators' targets)."""
        return id(value) in self._own

    def _build(self, inst: Any, state: Any) -> None:
        """BUILD as torch's unpickler does it, only on an object the pickle built."""
        if not self._is_own(inst):
            raise Refused(f"BUILD on {_describe(inst)}, which this load did not build")
        kind = type(inst)
        if kind is torch.Tensor:
            _set_tensor(inst, state)  # the legacy tensor format
        elif kind is torch.nn.Parameter:
            # Tensor.__setstate__ set_s any state of 4 items (a list, a dict's keys...)
            if type(state) is not tuple:
                raise Refused(f"BUILD of a Parameter from {type(state).__name__}")
            if len(state) == 4:
                _set_tensor(inst, state)
            else:
                inst.__setstate__(state)
        elif kind is OrderedDict:
            if type(state) is not dict:
                raise Refused(f"BUILD of an OrderedDict from {type(state).__name__}")
            _check_attributes(inst, state)
            inst.__dict__.update(state)
        elif id(kind) in self._classes:
            # The class's own __setstate__, never one the pickle put on the instance
            # (a first BUILD can set any attribute: torch's unpickler then calls it)
            setstate = getattr(kind, "__setstate__", None)
            if setstate is not None:
                self._settled()  # it may read a tensor it is given
                setstate(inst, state)
                return
            slotstate = None
            if isinstance(state, tuple) and len(state) == 2:
                state, slotstate = state
            # dicts only, as Python's unpickler reads them (torch's update() also takes
            # pairs; no writer makes those)
            if (state and type(state) is not dict) or (slotstate and type(slotstate) is not dict):
                raise Refused(f"BUILD of {_describe(inst)} from a state that is not a dict")
            if state:
                _check_attributes(inst, state)
                inst.__dict__.update(state)
            if slotstate:
                _check_attributes(inst, slotstate)
                for k, v in slotstate.items():
                    setattr(inst, k, v)
        else:
            raise Refused(
                "BUILD can only fill a Tensor, Parameter, OrderedDict or an instance of an "
                f"allowed class, not {_describe(inst)}"
            )

    def _check_target(self, target: Any, kinds: tuple[type, ...], op: str) -> None:
        if type(target) not in kinds or id(target) not in self._own:
            raise Refused(f"{op} into {_describe(target)}, which this load did not build")

    def _persistent(self, pid: Any) -> Any:
        if type(pid) is not tuple and type(pid) is not int:
            raise Refused(f"a persistent id of type {type(pid).__name__}")
        if type(pid) is tuple and (not pid or as_text(pid[0]) != "storage"):
            raise Refused("a persistent id that does not name a storage")
        if self.persistent_load is None:
            raise Refused("a persistent id in a pickle that holds no storages")
        found = self.persistent_load(pid)
        self._own.discard(id(found))
        return found

    def _nest(self, made: tuple[Any, ...]) -> None:
        """Record how deep ``made`` (a tuple holding tuples) nests; Refused past
        :data:`MAX_TUPLE_DEPTH`. CPython hashes a tuple by recursing into it with no
        depth check, so a dict key or set element nested a few hundred thousand deep
        overflows the C stack (``pickle.load`` and torch's unpickler crash on one); every
        tuple here comes from these opcodes, so bounding them bounds every hash."""
        depths = self._depths
        depth = 1 + max(depths.get(id(item), 1) for item in made if type(item) is tuple)
        if depth > MAX_TUPLE_DEPTH:
            raise Refused(
                f"tuples nested more than {MAX_TUPLE_DEPTH} deep (no checkpoint nests "
                "them; hashing one would overflow the interpreter's stack)"
            )
        depths[id(made)] = depth

    def load(self) -> Any:
        """The object the pickle describes. Opcodes are tested most frequent first (as
        ``torch.save`` writes them); the checks every policy shares are inlined for the
        common case and made in full by the methods above otherwise."""
        data = self.data
        end = len(data)
        extended = self.policy.opcodes
        runs = self._runs
        # while bytes are still being read, only calls that touch no tensor memory run
        # inline; the others go through _call, which settles first
        inline = self._callables - _SPECIAL_CALLABLE_IDS
        if self._settle is not None:
            inline &= _TOUCH_FREE_IDS
        plain_calls = {i: runs[i] for i in inline}
        plain_call = plain_calls.get
        fresh = self._fresh
        own = self._own
        mine = own.add
        not_mine = own.discard
        plain = self._plain  # (DCP's metadata dataclasses)
        setitem_types = _SETITEM_TYPES
        p4 = 0x94 in extended  # the policy admits protocol 4 (MEMOIZE and the rest)
        persistent = self._persistent
        load_storage = self.persistent_load
        stack: list[Any] = []
        append = stack.append
        marks: list[list[Any]] = []
        memo: dict[int, Any] = {}
        depths = self._depths
        depth_of = depths.get
        pos = 0
        while True:
            op = data[pos]  # IndexError past the end: damage
            pos += 1
            if op == 0x72:  # LONG_BINPUT
                memo[_unpack_I(data, pos)[0]] = stack[-1]
                pos += 4
            elif op == 0x68:  # BINGET
                append(memo[data[pos]])
                pos += 1
            elif op == 0x94 and p4:  # MEMOIZE
                memo[len(memo)] = stack[-1]
            elif op == 0x6A:  # LONG_BINGET
                append(memo[_unpack_I(data, pos)[0]])
                pos += 4
            elif op == 0x4B:  # BININT1
                append(data[pos])
                pos += 1
            elif op == 0x71:  # BINPUT
                memo[data[pos]] = stack[-1]
                pos += 1
            elif op == 0x58:  # BINUNICODE
                n = _unpack_I(data, pos)[0]
                pos += 4
                if pos + n > end:
                    raise EOFError("a string runs past the end")
                append(str(data[pos : pos + n], "utf-8", "surrogatepass"))
                pos += n
            elif op == 0x28:  # MARK
                marks.append(stack)
                stack = []
                append = stack.append
            elif op == 0x74:  # TUPLE
                items = stack
                stack = marks.pop()
                append = stack.append
                made = tuple(items)
                append(made)
                if tuple in map(type, made):  # how deep it nests (_nest), inline
                    depth = 1 + max([depth_of(id(i), 1) for i in made if type(i) is tuple])
                    if depth > MAX_TUPLE_DEPTH:
                        self._nest(made)  # raises
                    depths[id(made)] = depth
            elif op == 0x85:  # TUPLE1
                stack[-1] = made = (stack[-1],)
                if type(made[0]) is tuple:
                    self._nest(made)
            elif op == 0x52:  # REDUCE
                args = stack.pop()
                func = stack[-1]
                fid = id(func)
                run = plain_call(fid)
                if run is not None and type(args) is tuple:
                    stack[-1] = result = run(*args)
                    if fid in fresh:
                        mine(id(result))
                    else:
                        not_mine(id(result))
                else:
                    stack[-1] = self._call(func, args, "REDUCE")
            elif op == 0x51:  # BINPERSID
                pid = stack.pop()
                if type(pid) is tuple and pid and pid[0] == "storage" and load_storage:
                    found = load_storage(pid)  # what _persistent does, inlined
                    not_mine(id(found))
                    append(found)
                else:
                    append(persistent(pid))
            elif op == 0x89:  # NEWFALSE
                append(False)
            elif op == 0x29:  # EMPTY_TUPLE
                append(())
            elif op == 0x86:  # TUPLE2
                made = (stack[-2], stack[-1])
                stack[-2:] = [made]
                if type(made[0]) is tuple or type(made[1]) is tuple:
                    self._nest(made)
            elif op == 0x87:  # TUPLE3
                made = (stack[-3], stack[-2], stack[-1])
                stack[-3:] = [made]
                if tuple in map(type, made):
                    self._nest(made)
            elif op == 0x88:  # NEWTRUE
                append(True)
            elif op == 0x4E:  # NONE
                append(None)
            elif op == 0x75:  # SETITEMS
                items = stack
                stack = marks.pop()
                append = stack.append
                target = stack[-1]
                if type(target) not in setitem_types or id(target) not in own:
                    self._check_target(target, setitem_types, "SETITEMS")  # raises
                if len(items) % 2:
                    raise ValueError("SETITEMS with an odd number of items")
                for i in range(0, len(items), 2):
                    target[items[i]] = items[i + 1]
            elif op == 0x73:  # SETITEM
                value = stack.pop()
                key = stack.pop()
                target = stack[-1]
                if type(target) not in setitem_types or id(target) not in own:
                    self._check_target(target, setitem_types, "SETITEM")  # raises
                target[key] = value
            elif op == 0x4A:  # BININT
                append(_unpack_i(data, pos)[0])
                pos += 4
            elif op == 0x4D:  # BININT2
                append(_unpack_H(data, pos)[0])
                pos += 2
            elif op == 0x8C and p4:  # SHORT_BINUNICODE
                n = data[pos]
                pos += 1
                if pos + n > end:
                    raise EOFError("a string runs past the end")
                append(str(data[pos : pos + n], "utf-8", "surrogatepass"))
                pos += n
            elif op == 0x63:  # GLOBAL
                stop = data.find(b"\n", pos)
                middle = data.find(b"\n", stop + 1) if stop >= 0 else -1
                if middle < 0:
                    raise EOFError("a GLOBAL runs past the end")
                module = data[pos:stop].decode("utf-8")
                name = data[stop + 1 : middle].decode("utf-8")
                pos = middle + 1
                found = self.find_class(module, name)
                not_mine(id(found))
                append(found)
            elif op == 0x7D:  # EMPTY_DICT
                new_dict: dict[Any, Any] = {}
                mine(id(new_dict))
                append(new_dict)
            elif op == 0x5D:  # EMPTY_LIST
                new_list: list[Any] = []
                mine(id(new_list))
                append(new_list)
            elif op == 0x65:  # APPENDS
                items = stack
                stack = marks.pop()
                append = stack.append
                self._check_target(stack[-1], (list,), "APPENDS")
                stack[-1].extend(items)
            elif op == 0x61:  # APPEND
                item = stack.pop()
                target = stack[-1]
                if type(target) is not list or id(target) not in own:
                    self._check_target(target, (list,), "APPEND")  # raises
                target.append(item)
            elif op == 0x81:  # NEWOBJ
                args = stack.pop()
                cls = stack[-1]
                if id(cls) in plain and type(args) is tuple:
                    stack[-1] = new = cls.__new__(cls, *args)
                    mine(id(new))
                else:
                    stack[-1] = self._newobj(cls, args)
            elif op == 0x62:  # BUILD
                state = stack.pop()
                inst = stack[-1]
                if type(state) is dict and id(inst) in own and id(type(inst)) in plain:
                    inst.__dict__.update(state)
                else:
                    self._build(inst, state)
            elif op == 0x47:  # BINFLOAT
                append(_unpack_d(data, pos)[0])
                pos += 8
            elif op == 0x8A:  # LONG1
                n = data[pos]
                pos += 1
                if pos + n > end:
                    raise EOFError("a long runs past the end")
                append(int.from_bytes(data[pos : pos + n], "little", signed=True))
                pos += n
            elif op == 0x55:  # SHORT_BINSTRING
                n = data[pos]
                pos += 1
                if pos + n > end:
                    raise EOFError("a string runs past the end")
                raw = data[pos : pos + n]
                append(raw if self.encoding == "bytes" else raw.decode(self.encoding, "strict"))
                pos += n
            elif op == 0x8F:  # EMPTY_SET
                new_set: set[Any] = set()
                mine(id(new_set))
                append(new_set)
            elif op == 0x80:  # PROTO
                if data[pos] > pickle.HIGHEST_PROTOCOL:
                    raise ValueError(f"unsupported pickle protocol: {data[pos]}")
                pos += 1
            elif op == 0x2E:  # STOP
                return stack.pop()
            elif op not in extended:  # everything below: not in torch's opcode set
                if op not in _OPCODES:  # not pickle at all: damage
                    raise ValueError(f"byte {op:#04x} at {pos - 1} is not a pickle opcode")
                raise Refused(f"Unsupported operand {op} ({_opname(op)})")
            # Protocol 3-5 opcodes (DCP's .metadata); torch's policy never admits them.
            elif op == 0x95:  # FRAME: the frame's length, checked against the data
                if _unpack_Q(data, pos)[0] > end - pos - 8:
                    raise EOFError("a frame runs past the end")
                pos += 8
            elif op in _SIZED:  # SHORT_BINUNICODE, BINUNICODE8 and the BINBYTES
                width, text = _SIZED[op]
                n = data[pos] if width == 1 else _WIDTH[width](data, pos)[0]
                pos += width
                if pos + n > end:
                    raise EOFError("a string runs past the end")
                raw = data[pos : pos + n]
                append(str(raw, "utf-8", "surrogatepass") if text else raw)
                pos += n
            elif op == 0x94:  # MEMOIZE
                memo[len(memo)] = stack[-1]
            elif op == 0x93:  # STACK_GLOBAL
                name = stack.pop()
                module = stack.pop()
                if type(name) is not str or type(module) is not str:
                    raise Refused("STACK_GLOBAL with names that are not strings")
                found = self.find_class(module, name)
                not_mine(id(found))
                append(found)
            elif op == 0x90:  # ADDITEMS
                items = stack
                stack = marks.pop()
                append = stack.append
                self._check_target(stack[-1], (set,), "ADDITEMS")
                stack[-1].update(items)
            elif op == 0x91:  # FROZENSET
                items = stack
                stack = marks.pop()
                append = stack.append
                append(frozenset(items))
            elif op == 0x30:  # POP
                if stack:
                    stack.pop()
                else:
                    stack = marks.pop()
                    append = stack.append
            elif op == 0x31:  # POP_MARK
                stack = marks.pop()
                append = stack.append
            elif op == 0x32:  # DUP
                append(stack[-1])
            else:  # an opcode a policy lists but this machine lacks
                raise Refused(f"Unsupported operand {op} ({_opname(op)})")


_OPNAMES = {ord(info.code): info.name for info in pickletools.opcodes}
_OPCODES = frozenset(_OPNAMES)


def _opname(op: int) -> str:
    return _OPNAMES.get(op, "not an opcode")


def _describe(value: Any) -> str:
    """Names what a value is without calling anything it defines (no repr)."""
    if isinstance(value, type):
        return f"class {value.__module__}.{value.__qualname__}"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    return f"a {type(value).__module__}.{type(value).__qualname__}"


_rebuild_from_type_v2 = getattr(torch._tensor, "_rebuild_from_type_v2", None)


_STORAGE_CLASSES = frozenset(
    {torch.UntypedStorage, torch.storage.TypedStorage, *torch._storage_classes}
)
_TENSOR_CLASSES = frozenset({torch.Tensor, torch.nn.Parameter, *torch._tensor_classes})
#: Classes whose constructor, given an integer, allocates that many elements.
_INT_SIZED_CLASSES = _STORAGE_CLASSES | _TENSOR_CLASSES | {bytearray}
#: torch's rebuild functions: each call makes a new tensor (the device rebuild may
#: return the tensor it was given, which a rebuild made: _runtime checks it is own).
_REBUILDS_NEW = frozenset(
    getattr(torch._utils, n) for n in dir(torch._utils) if n.startswith("_rebuild_")
)
_tensor_setstate = torch.Tensor.__setstate__
#: Rebuilds that copy a tensor into new memory (``data.to(dtype, device)``) while the
#: pickle is read: bounded by :func:`check_materialised`.
_DEVICE_REBUILDS = frozenset(
    f
    for f in (
        getattr(torch._utils, "_rebuild_device_tensor_from_cpu_tensor", None),
        getattr(torch._utils, "_rebuild_device_tensor_from_numpy", None),
    )
    if f is not None
)
_SPARSE_CLASSES = frozenset(c for c in torch._tensor_classes if "sparse" in c.__module__)
#: Callables REDUCE checks further (RestrictedUnpickler._call): never on the fast path.
_rebuild_parameter_with_state = getattr(torch._utils, "_rebuild_parameter_with_state", None)


def _touch_free() -> frozenset[int]:
    """Ids of the allowed callables that neither read nor write a tensor's memory: a
    pickle may call them while the reader threads still fill the storages. Any other
    call (a device copy, a quantized or sparse or nested rebuild, which read tensors
    they are given; a class of the user's) waits for the bytes first."""
    names = (
        "_rebuild_tensor",
        "_rebuild_tensor_v2",
        "_rebuild_tensor_v3",
        "_rebuild_parameter",
        "_rebuild_meta_tensor_no_storage",
        "_rebuild_wrapper_subclass",
    )
    free: set[Any] = {getattr(torch._utils, n, None) for n in names}
    free |= {_rebuild_from_type_v2, torch.nn.Parameter, torch.Size, torch.device, OrderedDict}
    free |= {set, frozenset, complex, bytearray, codecs.encode}
    free |= _TENSOR_CLASSES - _SPARSE_CLASSES  # legacy classes: no arguments at all
    return frozenset(id(f) for f in free if f is not None)


_TOUCH_FREE_IDS = _touch_free()
_SPECIAL_CALLABLE_IDS = frozenset(
    id(c)
    for c in (
        *_INT_SIZED_CLASSES,
        *_SPARSE_CLASSES,
        *_DEVICE_REBUILDS,
        _rebuild_from_type_v2,
        _rebuild_parameter_with_state,
    )
)


def run_restricted(
    data: bytes | bytearray | memoryview,
    policy: Policy,
    persistent_load: Callable[[Any], Any] | None,
    url: str,
    what: str = "data.pkl",
    sparse: list[Any] | None = None,
    settle: Callable[[], None] | None = None,
) -> Any:
    """Unpickle ``data`` under ``policy``: the result, or a typed error naming ``url``.
    ``settle``: while storages are still being read, what waits until their bytes are
    in; called before the first call that may touch tensor memory.

    Refused content raises :class:`UnsafeCheckpointError`; damage (any other failure,
    whatever its type) :class:`CorruptCheckpointError`; cloudckpt's own errors raised
    by ``persistent_load`` pass through. Sparse tensors the load built are checked
    (:func:`validate_sparse`) before this returns; or, where ``sparse`` is a list
    (their storages are still being read), moved into it for the caller to check."""
    machine = RestrictedUnpickler(data, policy, persistent_load, settle=settle)
    try:
        result = machine.load()  # the caller's entry point pauses the collector
    except BaseException as exc:
        # torch's _rebuild_sparse_tensor queues what it built in a list of torch's; a
        # load that stops must not leave it there (the next load would validate it)
        sparse_queue().clear()
        if isinstance(exc, UnsafeCheckpointError):  # the policy's (Refused or its own)
            advice = f". {policy.advice}" if policy.advice else ""
            raise UnsafeCheckpointError(
                f"{url}: {what} holds what loading does not allow: {exc}{advice}"
            ) from None
        if isinstance(exc, (CloudCkptError, KeyboardInterrupt, SystemExit)):
            raise
        if not isinstance(exc, Exception):
            raise
        raise CorruptCheckpointError(  # every other failure of a pickle is damage
            f"{url}: {what} is not a valid pickle ({type(exc).__name__}: {short(exc)})"
        ) from None
    built = sparse_queue()
    if sparse is None:
        validate_sparse(list(built), url)
    else:
        sparse.extend(built)
    built.clear()
    return result


def sparse_queue() -> list[Any]:
    """torch's process-wide list of sparse tensors to validate after a load."""
    found = getattr(torch._utils, "_sparse_tensors_to_validate", None)
    return found if isinstance(found, list) else []


def check_extent(nbytes: int, offset: Any, size: Any, stride: Any, itemsize: int) -> None:
    """Refuse a view (offset, size, stride, in elements of ``itemsize`` bytes) that
    reaches past a storage of ``nbytes``: ``torch.load``'s storages cannot grow, but a
    storage cloudckpt made can, and ``set_`` would resize it to what the file asks."""
    if type(offset) is not int or offset < 0:
        what = repr(offset) if type(offset) is int else _describe(offset)  # no repr of a storage
        raise ValueError(f"storage offset {what} is not a non-negative integer")
    if len(size) != len(stride):
        raise ValueError(f"size and stride differ in length ({len(size)} and {len(stride)})")
    last = offset
    empty = False
    for n, step in zip(size, stride, strict=True):
        if type(n) is not int or type(step) is not int or n < 0 or step < 0:
            bad = n if type(n) is not int or n < 0 else step
            what = repr(bad) if type(bad) is int else _describe(bad)  # no str of a storage
            raise ValueError(f"a size or stride of a tensor is {what}, not a count")
        empty = empty or n == 0
        last += (n - 1) * step
    if not empty and (last + 1) * itemsize > nbytes:
        raise ValueError(
            f"a tensor of size {tuple(size)}, stride {tuple(stride)} at offset {offset} "
            f"reaches byte {(last + 1) * itemsize} of a storage of {nbytes}"
        )


def check_materialised(data: Any, dtype: Any, size: Any = None) -> None:
    """Refuse a rebuild that would allocate more than the bytes behind it: ``size``
    elements (default: ``data``'s) of ``dtype`` (default: ``data``'s) against the bytes
    of ``data``'s storage (a tensor) or buffer (an array). A view of 2**27 elements with
    stride 0 over 64 bytes is a fine view, but copied it is 2**27 elements; torch.save
    never writes such a copy (it saves a device tensor's ``.cpu()``, as many bytes)."""
    held: Any
    count: Any
    itemsize: Any
    if isinstance(data, torch.Tensor):
        held = data.untyped_storage().nbytes()
        count = data.numel() if size is None else math.prod(size)
        itemsize = data.element_size()
    elif isinstance(data, _STORAGES):
        held = data.nbytes()
        count = held if size is None else math.prod(size)
        itemsize = getattr(data, "dtype", torch.uint8).itemsize
    else:  # an array (_rebuild_device_tensor_from_numpy)
        held = getattr(data, "nbytes", None)
        count = getattr(data, "size", None)
        itemsize = getattr(getattr(data, "dtype", None), "itemsize", None)
    if isinstance(dtype, torch.dtype):
        itemsize = dtype.itemsize
    if type(held) is not int or type(count) is not int or type(itemsize) is not int:
        raise Refused(f"a device rebuild of {_describe(data)}")
    if count * itemsize > held:
        raise Refused(
            f"a rebuild would copy {count} elements of {itemsize} bytes out of {held} bytes "
            "(a view that repeats its elements); torch.save never writes one"
        )


def check_tensor_state(kind: type, state: Any) -> None:
    """Refuse a tensor's state (``(dict, slots)`` or a dict, as ``torch.save`` writes a
    tensor's ``__dict__`` and its subclass's slots) that names anything but plain
    attributes: ``real``, ``imag``, ``data``, ``grad``, ``__class__``... are setters of
    the tensor itself (``t.real = 0`` writes into the storage the reader threads are
    still filling; torch would write after its reads). A ``__dict__`` never holds such
    a name, and a slot is a member of a class below ``torch.Tensor``."""
    if isinstance(state, tuple) and len(state) == 2:
        attrs, slots = state
    else:
        attrs, slots = state, None
    for names, slot in ((attrs, False), (slots, True)):
        if not names:
            continue
        if type(names) is not dict:
            raise Refused(f"a tensor's state of {type(names).__name__}, not a dict")
        for name in names:
            found = _class_attribute(kind, name) if type(name) is str else None
            if slot:
                owner = getattr(found, "__objclass__", None)
                plain = (
                    isinstance(found, types.MemberDescriptorType)
                    and isinstance(owner, type)
                    and issubclass(owner, torch.Tensor)
                    and owner is not torch.Tensor
                )
            else:
                plain = type(name) is str and not hasattr(type(found), "__set__")
            if not plain:
                raise Refused(f"a tensor's state sets {name!r}, which is not an attribute")


def _class_attribute(kind: type, name: str) -> Any:
    """What ``name`` is on ``kind`` or a class above it (without running anything)."""
    for cls in kind.__mro__:
        found = cls.__dict__.get(name, _MISSING)
        if found is not _MISSING:
            return found
    return None


_MISSING = object()


def _check_constructor(func: Any, args: tuple[Any, ...], op: str) -> None:
    """Refuse a constructor that would allocate what the file asks rather than what it
    holds: a storage made other than by a persistent id; a legacy tensor class given
    anything at all (``FloatTensor(32768, 16384, True)``: a bool is an int too;
    ``FloatTensor(data)`` expands memoized lists), except the sparse ones, which
    allocate nothing for a size; ``bytearray`` of anything but text (``bytearray(n)``:
    n zero bytes). ``torch.save`` writes none of these."""
    if func not in _INT_SIZED_CLASSES:
        return
    if func in _STORAGE_CLASSES:
        raise Refused(f"{op} of {_describe(func)}: a storage comes only from a record")
    if func is bytearray:
        if all(type(a) is str or type(a) is bytes for a in args):
            return
    elif func in _SPARSE_CLASSES:
        if not args or not all(_size_like(a) for a in args):
            return
    elif not args or func is torch.nn.Parameter:
        return
    raise Refused(f"{op} of {_describe(func)} with arguments: allocates what the file asks")


def _size_like(value: Any) -> bool:
    """An integer (a bool, an int subclass, anything with ``__index__``) or a size."""
    return isinstance(value, (int, torch.Size)) or hasattr(type(value), "__index__")


def _check_attributes(inst: Any, state: dict[Any, Any]) -> None:
    """A BUILD state sets attributes by name: plain names only. A dunder name would set
    what the machine itself looks up (``__setstate__``) or change the object's class
    (``__class__`` through setattr); no writer's state holds one."""
    for key in state:
        if type(key) is not str or (key.startswith("__") and key.endswith("__")):
            raise Refused(f"BUILD of {_describe(inst)} setting the attribute {key!r:.60}")


def _set_tensor(tensor: torch.Tensor, state: Any) -> None:
    """BUILD's legacy form, ``tensor.set_(storage, offset, size[, stride])``, only over a
    storage and inside it: ``set_`` would otherwise resize the storage to what the file
    asks (torch's own storages cannot grow; check_extent says so before torch would)."""
    if type(state) is not tuple or len(state) not in (3, 4) or type(state[0]) not in _STORAGES:
        raise Refused("BUILD of a tensor from a state other than (storage, offset, size[, stride])")
    storage, offset, size = state[:3]
    if type(size) is not tuple and type(size) is not torch.Size:
        raise ValueError(f"a tensor size of type {type(size).__name__}")
    stride = state[3] if len(state) == 4 else contiguous_strides(size)
    if type(stride) is not tuple and type(stride) is not torch.Size:
        raise ValueError(f"a tensor stride of type {type(stride).__name__}")
    check_extent(storage.nbytes(), offset, size, stride, tensor.element_size())
    tensor.set_(*state)


def contiguous_strides(size: Any) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``size`` (every item an int, not a bool)."""
    strides: list[int] = []
    step = 1
    for n in reversed(tuple(size)):
        if type(n) is not int or n < 0:
            raise ValueError(f"size {tuple(size)} is not valid")
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


#: What ``object.__new__``-like constructors are: each call makes a new object.
_NEW_MAKERS = frozenset(
    id(m) for m in (object.__new__, dict.__new__, list.__new__, set.__new__, frozenset.__new__)
)


def _new_makes_new(cls: Any) -> bool:
    """Whether ``cls.__new__(cls, ...)`` always makes a new object (an ``Enum``'s returns
    an existing member; a C type's ``__new__`` may return a cached one)."""
    return isinstance(cls, type) and id(getattr(cls, "__new__", None)) in _NEW_MAKERS


def _makes_new(value: Any) -> bool:
    """Whether calling ``value`` (an allowed global) always makes a new object: torch's
    tensor rebuild functions and tensor classes, ``Parameter``, and classes built by
    ``type.__call__`` over a ``__new__`` that makes a new object (not an ``Enum``, whose
    call returns a shared member)."""
    if value in _REBUILDS_NEW or value in _TENSOR_CLASSES:
        return True
    return (
        isinstance(value, type) and type(value).__call__ is type.__call__ and _new_makes_new(value)
    )


def short(exc: BaseException) -> str:
    """An exception's text, cut to 300 characters for a message."""
    text = str(exc)
    return text if len(text) <= 300 else text[:300] + "..."


def validate_sparse(tensors: list[Any], url: str) -> None:
    """torch's check of sparse tensors after a load, where sparse invariant checks are on
    (``torch.sparse.check_sparse_tensor_invariants``), made on ``tensors``: those
    ``_rebuild_sparse_tensor`` and the legacy sparse classes built."""
    if not tensors:
        return
    queue = sparse_queue()
    queue.extend(tensors)
    try:
        torch._utils._validate_loaded_sparse_tensors()
    except Exception as exc:
        raise CorruptCheckpointError(f"{url}: a sparse tensor is malformed: {exc}") from None
    finally:
        queue.clear()
