"""The DLPack consumer: versioned and legacy capsules, consumption and deleters, flags, refusals."""

import ctypes
from ctypes import CFUNCTYPE, POINTER, Structure, c_int32, c_int64, c_uint8, c_uint16, c_uint32, c_uint64, c_void_p

import numpy as np
import pytest

import refit
from refit_testing import Ranks, bf16_bits


class DLDevice(Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class DLDataType(Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class DLTensor(Structure):
    _fields_ = [
        ("data", c_void_p),
        ("device", DLDevice),
        ("ndim", c_int32),
        ("dtype", DLDataType),
        ("shape", POINTER(c_int64)),
        ("strides", POINTER(c_int64)),
        ("byte_offset", c_uint64),
    ]


class DLPackVersion(Structure):
    _fields_ = [("major", c_uint32), ("minor", c_uint32)]


class DLManagedTensorVersioned(Structure):
    pass


class DLManagedTensor(Structure):
    pass


VersionedDeleter = CFUNCTYPE(None, POINTER(DLManagedTensorVersioned))
LegacyDeleter = CFUNCTYPE(None, POINTER(DLManagedTensor))
DLManagedTensorVersioned._fields_ = [
    ("version", DLPackVersion),
    ("manager_ctx", c_void_p),
    ("deleter", VersionedDeleter),
    ("flags", c_uint64),
    ("dl_tensor", DLTensor),
]
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", c_void_p), ("deleter", LegacyDeleter)]

PyCapsule_New = ctypes.pythonapi.PyCapsule_New
PyCapsule_New.restype = ctypes.py_object
PyCapsule_New.argtypes = [c_void_p, ctypes.c_char_p, c_void_p]


class Producer:
    """A hand-made DLPack producer over a NumPy float32 array, counting deleter calls."""

    def __init__(self, array, versioned=True, major=1, flags=0, code=2, bits=32, device=(1, 0)):
        self.array = array
        self.deleted = 0
        self.shape = (c_int64 * array.ndim)(*array.shape)
        self.versioned = versioned
        self.device = device
        tensor = DLTensor(
            array.ctypes.data, DLDevice(*device), array.ndim, DLDataType(code, bits, 1), self.shape, None, 0
        )
        if versioned:
            self.deleter = VersionedDeleter(self._delete)
            self.managed = DLManagedTensorVersioned(DLPackVersion(major, 0), None, self.deleter, flags, tensor)
        else:
            self.deleter = LegacyDeleter(self._delete)
            self.managed = DLManagedTensor(tensor, None, self.deleter)

    def _delete(self, _ptr):
        self.deleted += 1

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, *, stream=None, max_version=None):
        name = b"dltensor_versioned" if self.versioned else b"dltensor"
        if self.versioned and max_version is None:
            raise AssertionError("a versioned capsule needs max_version from the consumer")
        return PyCapsule_New(ctypes.addressof(self.managed), name, None)


@pytest.fixture
def ranks():
    r = Ranks()
    yield r
    r.close()


@pytest.mark.parametrize("versioned", [True, False], ids=["versioned", "legacy"])
def test_capsule_is_consumed_read_in_place_and_released_once(ranks, versioned):
    ranks.register_all()
    norm = "model.norm.weight"
    data = np.full(ranks.shards[norm].shape, 2.0, np.float32)
    producer = Producer(data, versioned=versioned)
    ranks.trainer.register(norm, producer)
    assert producer.deleted == 0  # held while registered
    assert ranks.trainer.registered(norm) is producer
    thread, box = ranks.serve_in_thread()
    ranks.trainer.refit(1)
    assert np.all(ranks.params[norm] == bf16_bits(np.float32(2.0).reshape(1))[0])
    # Replacing the registration releases the previous export exactly once.
    ranks.trainer.register(norm, ranks.shards[norm])
    assert producer.deleted == 1
    ranks.trainer.shutdown()
    thread.join(timeout=20)
    assert "error" not in box, box.get("error")


def test_close_releases_every_export(ranks):
    norm = "model.norm.weight"
    producer = Producer(np.zeros(ranks.shards[norm].shape, np.float32))
    ranks.trainer.register(norm, producer)
    ranks.trainer.close()
    assert producer.deleted == 1
    # What was registered is gone with the rank: asking raises, as every call after close() does.
    for ask in (lambda: ranks.trainer.unregistered(), lambda: ranks.trainer.registered(norm)):
        with pytest.raises(RuntimeError, match=r"after close\(\)"):
            ask()
    ranks.engine.close()
    with pytest.raises(RuntimeError, match=r"unregistered\(\) after close\(\)"):
        ranks.engine.unregistered()


def test_refused_capsules_name_the_tensor(ranks):
    norm = "model.norm.weight"
    shape = ranks.shards[norm].shape
    future = Producer(np.zeros(shape, np.float32), major=2)
    with pytest.raises(refit.SetupError, match=f"{norm}: DLPack capsule of major version 2"):
        ranks.trainer.register(norm, future)
    # A read-only export is fine to read (trainer) but not to write (engine).
    ro = Producer(np.zeros(shape, np.uint16), flags=1, code=1, bits=16)
    with pytest.raises(refit.SetupError, match=f"{norm} is read-only"):
        ranks.engine.register(norm, ro)
    ranks.trainer.register(norm, Producer(np.zeros(shape, np.float32), flags=1))
    # bf16 as its own DLPack type (code 4) is accepted where the engine stores bfloat16.
    ranks.engine.register(norm, Producer(np.zeros(shape, np.uint16), code=4, bits=16))
    with pytest.raises(refit.SetupError, match=f"{norm} registered as int16"):
        ranks.engine.register(norm, Producer(np.zeros(shape, np.int16), code=0, bits=16))


@pytest.mark.parametrize("versioned", [True, False], ids=["versioned", "legacy"])
def test_a_bare_capsule_is_placed_by_its_own_device_before_it_is_consumed(ranks, versioned):
    """A capsule passed as is (not an object with __dlpack__) says where its tensor is only in its
    DLTensor: refit reads that before taking the capsule, so a capsule on a device this config
    does not read is refused naming that device, and stays the caller's (not consumed, no
    deleter call)."""
    norm = "model.norm.weight"
    producer = Producer(np.zeros(ranks.shards[norm].shape, np.float32), versioned=versioned,
                        device=(2, 0))  # kDLCUDA, device 0
    capsule = producer.__dlpack__(max_version=(1, 0))
    name = b"dltensor_versioned" if versioned else b"dltensor"
    with pytest.raises(refit.SetupError, match=f"{norm} is on cuda:0; with device: cpu"):
        ranks.trainer.register(norm, capsule)
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    assert get_name(capsule) == name
    assert producer.deleted == 0
    # The same capsule, on the host, is taken as it is.
    producer.managed.dl_tensor.device = DLDevice(1, 0)
    ranks.trainer.register(norm, capsule)
    assert get_name(capsule) == b"used_" + name
