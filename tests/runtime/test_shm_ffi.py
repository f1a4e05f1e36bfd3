"""``runtime.shm_ffi``: the XLA FFI target of the shared-memory allreduce, called from compiled code.

A group of one (an arena of one rank) makes the sum the identity, which checks the target's plumbing in
this process: dtypes, shapes, the token, the aliasing of result and operand, and failures coming back as
errors of the compiled call. Sums over several ranks are ``test_shm_collective.py``'s and the collective
training tests'."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from runtime import shm_collective, shm_ffi

pytestmark = pytest.mark.skipif(shm_collective.unusable_reason([shm_collective.host_identity()]) is not None,
                                reason="no shared-memory arena on this machine")


@pytest.fixture
def arena():
    fd, path = shm_collective.create(1, 1 << 16)  # 64 KiB slots: larger buffers go in chunks
    try:
        one = shm_collective.Arena(fd, 0, 1, 5.0)
    finally:
        os.close(fd)
        os.unlink(path)
    shm_ffi.install(one)
    yield one
    shm_ffi.install(None)
    one.close()


def step(x):
    token, out = shm_ffi.allreduce(jnp.zeros((), jnp.int32), x * 2)
    token, out = shm_ffi.allreduce(token, out + 1)
    return token, out


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int8, ml_dtypes.bfloat16])
@pytest.mark.parametrize("shape", [(), (7,), (300, 129)])
def test_a_group_of_one_sums_to_the_value_in_every_dtype_and_shape(arena, dtype, shape) -> None:
    with jax.enable_x64(np.dtype(dtype).itemsize == 8):
        x = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape).astype(dtype)
        token, out = jax.jit(step)(jnp.asarray(x))
        assert int(token) == 2  # two chained calls
        assert out.dtype == np.dtype(dtype) and out.shape == shape
        np.testing.assert_array_equal(np.asarray(out), (x * 2 + 1).astype(dtype))


def test_a_failed_call_raises_from_the_compiled_step_naming_why(arena) -> None:
    arena.failure = "trainer 1 left"
    with pytest.raises(jax.errors.JaxRuntimeError, match="failed earlier: trainer 1 left"):
        jax.jit(step)(jnp.ones(4)).__getitem__(1).block_until_ready()


def test_without_an_arena_the_call_says_so() -> None:
    shm_ffi.install(None)
    with pytest.raises(jax.errors.JaxRuntimeError, match="no shared-memory arena is installed"):
        jax.jit(step)(jnp.ones(4))[1].block_until_ready()
