"""A ``.pt`` dataset: the one tensor ``torch.save`` writes, read without torch.

``torch.load(weights_only=True)`` runs the file's pickle with an allowlist, and that is not enough
for a file any member of group ds-ops can drop: ``bytearray(n)`` is on the list (a 60-byte file
asked for 1.5 GB: CI's fuzzer, 2026-12-07), and a view of one float with strides 0 that the
unpickler iterates builds millions of tensors (the hostile review after it). So this module runs
the pickle itself, as a small stack machine that knows only what ``torch.save`` writes for one
tensor (or one ``nn.Parameter``)::

    _rebuild_tensor_v2(<persistent id of a storage>, offset, size, stride, requires_grad, OrderedDict())
    _rebuild_tensor_v3(..., dtype)            # uint16, uint32, uint64: an UntypedStorage and its dtype
    _rebuild_parameter(<one of those>, requires_grad, OrderedDict())

and refuses any other opcode, name or argument. The storage's record is then read with Python's
zipfile (the only parser of the file, so no two readers can see two archives; only stored
members, as torch.save writes them, so nothing is inflated) into memory, within twice
``job.max_matrix_bytes``, after a check in Python's integers that the tensor's offset, shape and
strides stay inside it (numpy's own check wraps at 2**64), and viewed by numpy. Nothing is
imported from torch.
"""

from __future__ import annotations

import lzma
import pickletools
import warnings
import zipfile
import zlib

import numpy as np

from .core import DatasetError, DatasetLimits, check_shape, clip, open_zip, read_exact

MAX_PICKLE = 1 << 16  # the data.pkl of one tensor has about 300 bytes
MAX_TUPLE, MAX_INT = 8, 1 << 62  # torch.save's longest tuple has 7 items (v3's arguments); sizes, strides < 2**62
_REBUILD = "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3", "torch._utils._rebuild_parameter"
# storage types and dtypes -> numpy's type code ("bf16": bfloat16, read as its 16 bits); None: not a real number type
_STORAGES = {"Float": "f4", "Double": "f8", "Half": "f2", "BFloat16": "bf16", "Long": "i8", "Int": "i4", "Short": "i2",
             "Char": "i1", "Byte": "u1", "Bool": None, "ComplexFloat": None, "ComplexDouble": None, "QInt8": None,
             "QUInt8": None, "QInt32": None, "QUInt4x2": None, "QUInt2x4": None}
_DTYPES = {"uint16": "u2", "uint32": "u4", "uint64": "u8"}
_NAMES = {*_REBUILD, "collections.OrderedDict", "torch.storage.UntypedStorage",
          *(f"torch.{k}Storage" for k in _STORAGES), *(f"torch.{k}" for k in _DTYPES)}
_ODICT = ("OrderedDict()",)  # the empty OrderedDict of a tensor's backward hooks


class _Mark:
    pass


class _Storage:
    def __init__(self, name: str, key: str, numel: int):
        self.type, self.key, self.numel = name, key, numel


class _Tensor:
    def __init__(self, storage: _Storage, offset: int, size: tuple, stride: tuple, code: str | None, dtype: str):
        self.storage, self.offset, self.size, self.stride, self.code, self.dtype = storage, offset, size, stride, code, dtype


class _Global(str):
    pass


def _refuse(path: str, why: str) -> DatasetError:
    return DatasetError(f"{path}: not a plain tensor file ({why}; ds-ops reads one tensor as torch.save writes it)")


def _ints(v) -> bool:
    return isinstance(v, tuple) and all(type(x) is int and x >= 0 for x in v)


def _call(path: str, func: _Global, args) -> object:
    """What torch.save's REDUCE of ``func`` gives, checked: a tensor, or its hooks' empty OrderedDict."""
    if func == "collections.OrderedDict" and args == ():
        return _ODICT
    if func == "torch._utils._rebuild_parameter" and isinstance(args, tuple) and len(args) == 3 \
            and isinstance(args[0], _Tensor) and type(args[1]) is bool and args[2] is _ODICT:
        return args[0]
    v3 = func == "torch._utils._rebuild_tensor_v3"
    if func in _REBUILD[:2] and isinstance(args, tuple) and len(args) == 6 + v3:
        storage, offset, size, stride, grad, hooks = args[:6]
        if isinstance(storage, _Storage) and type(offset) is int and offset >= 0 and _ints(size) and _ints(stride) \
                and len(size) == len(stride) and type(grad) is bool and hooks is _ODICT:
            if not v3 and storage.type.startswith("torch.") and storage.type.endswith("Storage"):
                kind = storage.type[len("torch."):-len("Storage")]
                return _Tensor(storage, offset, size, stride, _STORAGES.get(kind), kind.lower())
            if v3 and storage.type == "torch.storage.UntypedStorage" and isinstance(args[6], _Global) \
                    and args[6].removeprefix("torch.") in _DTYPES:
                dtype = args[6].removeprefix("torch.")
                return _Tensor(storage, offset, size, stride, _DTYPES[dtype], dtype)
    raise _refuse(path, f"its pickle calls {func} with arguments torch.save does not write for a tensor")


def _interpret(path: str, pkl: bytes) -> _Tensor:
    """Run ``pkl`` on symbolic values; return the tensor it builds, or raise DatasetError."""
    stack: list = []
    memo: dict[int, object] = {}

    def pop_mark() -> tuple:
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is _Mark:
                items = tuple(stack[i + 1:])
                del stack[i:]
                return items
        raise _refuse(path, "its pickle's TUPLE has no MARK")

    try:
        with warnings.catch_warnings():  # genops decodes a GLOBAL's escapes: a DeprecationWarning for a bad one
            warnings.simplefilter("ignore")
            ops = list(pickletools.genops(pkl))  # at most MAX_PICKLE bytes: a few thousand opcodes
        if ops and ops[0][0].name != "PROTO":
            raise _refuse(path, "its pickle is protocol 0 or 1; torch.save writes 2")
        for op, arg, pos in ops:
            name = op.name
            if name == "PROTO":
                if arg > 3:
                    raise _refuse(path, f"its pickle is protocol {arg}; torch.save writes 2")
            elif name == "GLOBAL":
                dotted = arg.replace(" ", ".", 1)
                if dotted not in _NAMES:
                    raise _refuse(path, f"its pickle calls {clip(dotted)}")
                stack.append(_Global(dotted))
            elif name == "MARK":
                stack.append(_Mark)
            elif name in ("BINUNICODE", "SHORT_BINUNICODE", "BININT", "BININT1", "BININT2", "LONG1"):
                if isinstance(arg, int) and not -MAX_INT <= arg <= MAX_INT:
                    raise _refuse(path, f"its pickle's integer at byte {pos} is beyond 2**62 either way")
                stack.append(arg)
            elif name in ("NEWTRUE", "NEWFALSE"):
                stack.append(name == "NEWTRUE")
            elif name == "EMPTY_TUPLE":
                stack.append(())
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                n = int(name[-1])
                items = tuple(stack[-n:])
                if len(items) < n or any(x is _Mark for x in items):
                    raise _refuse(path, f"its pickle's {name} at byte {pos} has too few items")
                del stack[-n:]
                stack.append(items)
            elif name == "TUPLE":
                items = pop_mark()
                if len(items) > MAX_TUPLE:
                    raise _refuse(path, f"its pickle's TUPLE at byte {pos} has {len(items)} items")
                stack.append(items)
            elif name in ("BINPUT", "LONG_BINPUT"):
                memo[arg] = stack[-1]
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif name in ("BINGET", "LONG_BINGET"):
                stack.append(memo[arg])
            elif name == "BINPERSID":
                pid = stack.pop()
                if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _Global)
                        and isinstance(pid[2], str) and isinstance(pid[3], str) and type(pid[4]) is int and pid[4] >= 0):
                    raise _refuse(path, "its pickle's storage id is not torch.save's")
                stack.append(_Storage(pid[1], pid[2], pid[4]))
            elif name == "REDUCE":
                args, func = stack.pop(), stack.pop()
                if not isinstance(func, _Global):
                    raise _refuse(path, f"its pickle's REDUCE at byte {pos} calls no name")
                stack.append(_call(path, func, args))
            elif name == "STOP":
                if len(stack) != 1 or not isinstance(stack[0], _Tensor):
                    raise _refuse(path, "its pickle does not give one tensor")
                return stack[0]
            else:
                what = {"EMPTY_DICT": "a dict", "DICT": "a dict", "EMPTY_LIST": "a list", "LIST": "a list"}.get(name)
                raise _refuse(path, f"its pickle has {name} at byte {pos}" + (
                    f", building {what}: save the one tensor, torch.save(obj[KEY], FILE)" if what else ""))
    except DatasetError:
        raise
    except (IndexError, KeyError):  # a pop from an empty stack, a BINGET of nothing put
        raise _refuse(path, "its pickle's stack or memo does not hold what an opcode takes") from None
    except ValueError as e:  # pickletools: an unknown opcode, an argument cut short, no STOP
        raise _refuse(path, f"its pickle does not parse: {clip(str(e))}") from None
    raise _refuse(path, "its pickle has no STOP")


def read_pt(path: str, limits: DatasetLimits) -> tuple[np.ndarray, str]:
    """Return (the tensor as a numpy view of its storage, numpy type code; ``bf16`` for bfloat16,
    viewed as uint16) of a ``torch.save`` archive of one 2-D real tensor; raise DatasetError for
    anything else. The storage is read into memory (at most twice ``job.max_matrix_bytes``)."""
    with open(path, "rb") as f:
        if f.read(4) != b"PK\x03\x04":  # torch.load's own test: anything else is its legacy format
            raise DatasetError(f"{path}: not a torch.save zip archive (torch >= 1.6 writes one; the legacy "
                               "format is not read)")
    try:
        with open_zip(path) as z:
            for i in z.infolist():  # torch.save stores its members: nothing to inflate, no decompressor to bound
                if i.compress_type != zipfile.ZIP_STORED:
                    raise DatasetError(f"{path}: its member {clip(i.filename)!r} is compressed; torch.save stores "
                                       "its members (save the tensor again with torch.save)")
                if i.compress_size != i.file_size:
                    raise _refuse(path, f"its stored member {clip(i.filename)!r} claims {i.file_size} bytes and "
                                        f"holds {i.compress_size}")
            tops = {n.split("/", 1)[0] for n in z.namelist()}
            prefix = next(iter(tops)) if len(tops) == 1 else None
            info = _member(z, f"{prefix}/data.pkl") if prefix else None
            if info is None:
                raise DatasetError(f"{path}: not a torch.save archive (no single folder holding data.pkl)")
            if info.file_size > MAX_PICKLE:
                raise _refuse(path, f"its pickle has {info.file_size} bytes; a tensor's has a few hundred")
            t = _interpret(path, z.read(info))
            if t.code is None:
                raise DatasetError(f"{path}: tensor has dtype {t.dtype}; need a real number dtype")
            try:
                check_shape(path, "tensor", t.size, limits)  # before any data is read
            except DatasetError as e:
                if len(t.size) != 2 or t.size[0] * t.size[1] * 4 <= limits.max_matrix_bytes:
                    raise
                raise DatasetError(f"{e} (a .pt is read whole: save it as a C-ordered .npy, "
                                   "np.save(path, t.numpy()), which a training job streams)") from None
            item = 2 if t.code == "bf16" else int(t.code[1:])
            nbytes = t.storage.numel * (1 if t.storage.type == "torch.storage.UntypedStorage" else item)
            record = _member(z, f"{prefix}/data/{t.storage.key}")
            if record is None or record.file_size != nbytes:
                raise _refuse(path, f"its storage {clip(t.storage.key)!r} is not a record of {nbytes} bytes")
            if nbytes > 2 * limits.max_matrix_bytes + 64:  # a float64 storage of the matrix, whole
                raise DatasetError(f"{path}: its tensor's storage holds {nbytes} bytes, over twice job.max_matrix_bytes "
                                   f"({limits.max_matrix_bytes}) (a view of a larger tensor: save the view's .clone())")
            _check_bounds(path, t, nbytes // item)
            order = _byteorder(path, z, prefix)
            buf = np.empty(nbytes, dtype=np.uint8)
            with z.open(record) as f:
                read_exact(f, buf, path)  # a record cut short raises: no heap bytes left in buf
    except DatasetError:
        raise
    except (zipfile.BadZipFile, EOFError, NotImplementedError, OSError, RuntimeError, ValueError, zlib.error,
            lzma.LZMAError) as e:
        raise DatasetError(f"{path}: not a torch.save zip archive ({type(e).__name__}: {clip(str(e))})") from None
    dtype = np.dtype("u2" if t.code == "bf16" else t.code).newbyteorder(order)
    # a dimension of one row or none never steps: its stride (any value torch kept) is not used
    view = np.ndarray(t.size, dtype=dtype, buffer=buf, offset=t.offset * item,
                      strides=tuple(s * item if d > 1 and all(t.size) else 0 for d, s in zip(t.size, t.stride)))
    return view, t.code


def _check_bounds(path: str, t: _Tensor, numel: int) -> None:
    """Raise DatasetError unless every element of the view lies in its storage of ``numel`` elements,
    in Python's integers (numpy's own check wraps at 2**64: a stride of (2**64 + 8) // 12 passed it)."""
    last = t.offset + sum((d - 1) * s for d, s in zip(t.size, t.stride))
    empty = not all(t.size)  # a view of no element reads nothing
    if t.offset > numel or not empty and (any(s > numel for d, s in zip(t.size, t.stride) if d > 1) or last >= numel):
        raise _refuse(path, f"its offset {t.offset}, size {t.size} and stride {t.stride} reach past its storage "
                            f"of {numel} elements")


def _member(z: zipfile.ZipFile, name: str) -> zipfile.ZipInfo | None:
    """The archive's one member ``name`` (None where there is none, or more than one)."""
    found = [i for i in z.infolist() if i.filename == name]
    return found[0] if len(found) == 1 else None


def _byteorder(path: str, z: zipfile.ZipFile, prefix: str) -> str:
    """``<`` or ``>``: the archive's byteorder record (torch.save writes one; without it, little)."""
    info = _member(z, f"{prefix}/byteorder")
    if info is None:
        return "<"
    if info.file_size > 16:
        raise _refuse(path, f"its byteorder record has {info.file_size} bytes")
    value = z.read(info)
    if value not in (b"little", b"big"):
        raise _refuse(path, f"its byteorder record says {clip(value.decode('latin-1'))!r}")
    return "<" if value == b"little" else ">"
