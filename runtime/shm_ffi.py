"""The XLA FFI target through which a compiled step calls the shared-memory allreduce.

``flotilla_shm_allreduce`` is a typed-FFI handler (XLA's C ABI, ``xla/ffi/api/c_api.h``) written with
ctypes: XLA calls it with its own argument and result buffers, so the sum is read from and written back to
the step's buffer in place (the result aliases the operand), with no copy into or out of a Python object
and no fresh output buffer to page-fault in. ``jax.pure_callback`` and JAX's host-callback lowering copy
the operand and the result instead: ~12 ms of a 64 MiB call here.

Arguments: a scalar int32 token and the buffer to sum; results: the token plus one and the summed buffer
(aliased to the operand). The token chains a step's calls so XLA runs them in trace order. The handler
sums through this process's arena (``install``); a failure becomes an FFI error naming its cause, which
JAX raises from the compiled call.

Invariants: one arena a process (the group's); the handler is registered once a process and kept alive
with the module (XLA holds only its address); the structure layouts below are those of XLA FFI API 0.x,
checked against the ``struct_size`` XLA passes.
"""
from __future__ import annotations

import ctypes as C
from typing import Any

import numpy as np

TARGET = "flotilla_shm_allreduce"
_API_MAJOR, _API_MINOR = 0, 3
_EXTENSION_METADATA = 1
_STAGE_EXECUTE = 3
_ERROR_UNAVAILABLE = 14


class _ExtensionBase(C.Structure):
    pass


_ExtensionBase._fields_ = [("struct_size", C.c_size_t), ("type", C.c_int), ("next", C.POINTER(_ExtensionBase))]


class _ApiVersion(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p), ("major", C.c_int), ("minor", C.c_int)]


class _Metadata(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("api_version", _ApiVersion), ("traits", C.c_uint32),
                ("state_type_id", C.c_int64)]


class _MetadataExtension(C.Structure):
    _fields_ = [("base", _ExtensionBase), ("metadata", C.POINTER(_Metadata))]


class _Buffer(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p), ("dtype", C.c_int),
                ("data", C.c_void_p), ("rank", C.c_int64), ("dims", C.POINTER(C.c_int64))]


class _List(C.Structure):  # XLA_FFI_Args and XLA_FFI_Rets share this layout
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p), ("size", C.c_int64),
                ("types", C.POINTER(C.c_int)), ("items", C.POINTER(C.c_void_p))]


class _Attrs(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p), ("size", C.c_int64),
                ("types", C.c_void_p), ("names", C.c_void_p), ("attrs", C.c_void_p)]


class _CallFrame(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.POINTER(_ExtensionBase)), ("api", C.c_void_p),
                ("ctx", C.c_void_p), ("stage", C.c_int), ("args", _List), ("rets", _List), ("attrs", _Attrs),
                ("future", C.c_void_p)]


class _ErrorCreateArgs(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p), ("message", C.c_char_p),
                ("errc", C.c_int)]


# XLA sets struct_size to the end of a structure's last versioned field (the call frame's ``attrs``).
_FRAME_SIZE = _CallFrame.attrs.offset + C.sizeof(_Attrs)
_ERROR_CREATE = C.CFUNCTYPE(C.c_void_p, C.POINTER(_ErrorCreateArgs))
# XLA_FFI_Api: struct_size, extension_start, api_version (24 bytes), internal_api, then XLA_FFI_Error_Create.
_ERROR_CREATE_OFFSET = 8 + 8 + C.sizeof(_ApiVersion) + 8


def _dtypes() -> dict[int, np.dtype]:
    import ml_dtypes

    return {2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32), 5: np.dtype(np.int64),
            6: np.dtype(np.uint8), 7: np.dtype(np.uint16), 8: np.dtype(np.uint32), 9: np.dtype(np.uint64),
            10: np.dtype(np.float16), 11: np.dtype(np.float32), 12: np.dtype(np.float64),
            16: np.dtype(ml_dtypes.bfloat16)}


_DTYPES = _dtypes()
_arena: Any = None


def _array(pointer: int) -> np.ndarray:
    buf = C.cast(pointer, C.POINTER(_Buffer)).contents
    if buf.struct_size < C.sizeof(_Buffer):
        raise TypeError(f"XLA's FFI buffer is {buf.struct_size} bytes, not {C.sizeof(_Buffer)}")
    dtype = _DTYPES.get(buf.dtype)
    if dtype is None:
        raise TypeError(f"the shared-memory allreduce cannot sum XLA dtype {buf.dtype}")
    count = 1
    for i in range(buf.rank):
        count *= buf.dims[i]
    raw = np.ctypeslib.as_array(C.cast(buf.data, C.POINTER(C.c_uint8)), (count * dtype.itemsize,))
    return raw.view(dtype)


def _error(api: int, message: str) -> int:
    create = _ERROR_CREATE(C.cast(api + _ERROR_CREATE_OFFSET, C.POINTER(C.c_void_p))[0])
    args = _ErrorCreateArgs(C.sizeof(_ErrorCreateArgs), None, message.encode("utf-8", "replace"), _ERROR_UNAVAILABLE)
    return create(C.byref(args))


def _handler(frame_pointer: Any) -> int | None:
    frame = frame_pointer.contents
    if frame.struct_size < _FRAME_SIZE:  # another FFI ABI than the one mirrored here
        return _error(frame.api, f"XLA's FFI call frame is {frame.struct_size} bytes, not the {_FRAME_SIZE} "
                                 "this handler reads; set FLAGS_cpu_allreduce=xla")
    extension = frame.extension_start
    if extension and extension.contents.type == _EXTENSION_METADATA:  # XLA asks which FFI API we speak
        metadata = C.cast(extension, C.POINTER(_MetadataExtension)).contents.metadata.contents
        metadata.api_version.major, metadata.api_version.minor = _API_MAJOR, _API_MINOR
        metadata.traits = 0
        return None
    if frame.stage != _STAGE_EXECUTE:
        return None
    try:
        if _arena is None:
            raise RuntimeError("no shared-memory arena is installed in this process (runtime.shm_ffi.install)")
        token_in, data = _array(frame.args.items[0]), _array(frame.args.items[1])
        token_out, out = _array(frame.rets.items[0]), _array(frame.rets.items[1])
        if out.ctypes.data != data.ctypes.data:  # XLA kept the operand: sum into the result
            np.copyto(out, data)
        _arena.allreduce_into(out)
        token_out[...] = token_in + 1
        return None
    except BaseException as e:  # noqa: BLE001 - every failure goes back to XLA, which raises it in the caller
        return _error(frame.api, f"{type(e).__name__}: {getattr(e, 'message', None) or e}")


_HANDLER = C.CFUNCTYPE(C.c_void_p, C.POINTER(_CallFrame))(_handler)
_registered = False


def install(arena: Any) -> None:
    """Make ``arena`` the one the target sums through, registering the target with XLA the first time."""
    global _arena, _registered
    import jax

    _arena = arena
    if _registered:
        return
    new_capsule = C.pythonapi.PyCapsule_New
    new_capsule.restype = C.py_object
    new_capsule.argtypes = [C.c_void_p, C.c_char_p, C.c_void_p]
    capsule = new_capsule(C.cast(_HANDLER, C.c_void_p).value, b"xla._CUSTOM_CALL_TARGET", None)
    jax.ffi.register_ffi_target(TARGET, capsule, platform="cpu")
    _registered = True


def allreduce(token: Any, x: Any) -> tuple[Any, Any]:
    """Trace one call: the next token and the sum of ``x`` over the group (in place of ``x``)."""
    import jax

    call = jax.ffi.ffi_call(TARGET, (jax.ShapeDtypeStruct((), token.dtype), jax.ShapeDtypeStruct(x.shape, x.dtype)),
                            input_output_aliases={1: 1})
    token_out, out = call(token, x)
    return token_out, out


__all__ = ["TARGET", "allreduce", "install"]
