"""DLPack producers and bfloat16: torch tensors (bfloat16 included) read in place on every
device and both OpenCL kernel families, results back as torch tensors of the input dtype,
against the float64 reference with FlashAttention-2's rule for low precision (error at most
twice that of torch's own attention at that dtype, plus a small epsilon)."""
import ctypes
import json
import sys

import numpy as np
import pytest

from conftest import DEVICE_IDS, OPENCL_IDS, run_python
from orchard.reference import ref_bwd, ref_fwd

torch = pytest.importorskip("torch")
F = torch.nn.functional
LOW = [torch.float16, torch.bfloat16]
FEATURES = {"plain": {}, "causal": dict(causal=True), "window": dict(window=(7, 2)),
            "softcap": dict(softcap=3.0), "alibi": dict(alibi_slopes=np.linspace(0.1, 0.5, 4))}


class DLPackOnly:
    """A producer that only speaks DLPack (as a JAX array would)."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, **kw):
        return self.array.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def torch_reference(q, k, v, dout, causal=False, window=(-1, -1), softcap=0.0,
                    alibi_slopes=None):
    """The same attention computed by plain torch at the tensors' dtype (the yardstick of the
    rule), with its gradients."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    nq, nk = q.shape[-2], k.shape[-2]
    i = torch.arange(nq)[:, None] + nk - nq
    j = torch.arange(nk)[None, :]
    if alibi_slopes is not None:
        s = s - torch.tensor(alibi_slopes, dtype=s.dtype)[:, None, None] * (i - j).abs()
    left, right = window
    if causal:
        right = 0
    mask = ((left >= 0) & (j < i - left)) | ((right >= 0) & (j > i + right))
    out = torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1) @ v
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def check(got, ref, mine, name):
    """FlashAttention-2's rule: |orchard - ref| <= 2 |torch at that dtype - ref| + eps."""
    err = (got.double() - torch.from_numpy(ref)).abs().max().item()
    base = (mine.double() - torch.from_numpy(ref)).abs().max().item()
    assert err <= 2 * base + 1e-3, "%s: error %.3g against torch's %.3g" % (name, err, base)


@pytest.mark.parametrize("device", DEVICE_IDS)
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("feature", list(FEATURES))
def test_low_precision_tensors(ops, device, dtype, feature):
    kw = FEATURES[feature]
    g = torch.Generator().manual_seed(len(feature))
    q, k, v, dout = (torch.randn(2, 4, 70, 40, generator=g).to(dtype) for _ in range(4))
    ops.reset_stats()
    out, lse = ops.flash_attn_fwd(q, k, v, device=device, **kw)
    dq, dk, dv = ops.flash_attn_bwd(dout, q, k, v, out, lse, device=device, **kw)
    for t in (out, dq, dk, dv):
        assert isinstance(t, torch.Tensor) and t.dtype == dtype
    assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32
    if device == "cpu":     # read in place: nothing staged on the native path
        assert ops.stats()["per_device"]["cpu"]["staged_buffers"] == 0
    q64, k64, v64, do64 = (t.double().numpy() for t in (q, k, v, dout))
    ro, rl = ref_fwd(q64, k64, v64, **kw)
    rq, rk, rv = ref_bwd(do64, q64, k64, v64, **kw)
    mo, mq, mk, mv = torch_reference(q, k, v, dout, **kw)
    check(out, ro, mo, "out")
    np.testing.assert_allclose(lse.numpy(), rl, atol=2e-2)
    for got, ref, mine, name in ((dq, rq, mq, "dq"), (dk, rk, mk, "dk"), (dv, rv, mv, "dv")):
        check(got, ref, mine, name)


FAMILY_RUN = """
import json, torch, orchard_ops as o
from orchard.reference import ref_fwd
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 130, 24, generator=g).to(torch.bfloat16) for _ in range(3))
out, lse = o.flash_attn_fwd(q, k, v, causal=True, device="%s")
ref, _ = o.flash_attn_fwd(q, k, v, causal=True, device="cpu")
dq = o.flash_attn_bwd(out, q, k, v, out, lse, causal=True, device="%s")[0]
dqr = o.flash_attn_bwd(out, q, k, v, out, lse, causal=True, device="cpu")[0]
# the split-KV decode: 4 query rows of 4 heads over 2 kv heads, 2,000 keys (several splits)
qd = torch.randn(1, 4, 4, 24, generator=g).to(torch.bfloat16)
kd, vd = (torch.randn(1, 2, 2000, 24, generator=g).to(torch.bfloat16) for _ in range(2))
outd, _ = o.flash_attn_fwd(qd, kd, vd, softcap=4.0, device="%s")
refd = ref_fwd(*(t.double().numpy() for t in (qd, kd, vd)), softcap=4.0)[0]
print(json.dumps([str(out.dtype), (out.float() - ref.float()).abs().max().item(),
                  (dq.float() - dqr.float()).abs().max().item(), str(outd.dtype),
                  float(abs(outd.double().numpy() - refd).max())]))
"""


@pytest.mark.skipif(not OPENCL_IDS, reason="no OpenCL device listed")
@pytest.mark.parametrize("family", ["rows", "tiled", "wg"])
def test_bfloat16_kernel_families(family):
    """bfloat16 storage in every OpenCL kernel family agrees with the native path to a
    bfloat16 rounding; their split-KV decode with the float64 reference too."""
    dev = OPENCL_IDS[0]
    r = run_python(FAMILY_RUN % (dev, dev, dev), timeout=300, ORCHARD_CL_FAMILY=family)
    assert r.returncode == 0, r.stderr
    dtype, err_out, err_dq, dtype_d, err_d = json.loads(r.stdout.splitlines()[-1])
    assert dtype == "torch.bfloat16" and err_out <= 2 ** -7 and err_dq <= 2 ** -5
    assert dtype_d == "torch.bfloat16" and err_d <= 2 ** -10     # |out| < 2 ** -3: 2 ulps


@pytest.mark.parametrize("device", DEVICE_IDS)
def test_bfloat16_rounds_to_nearest_even(ops, device):
    """Results are computed in float32 and rounded once, to nearest even, as torch rounds:
    two keys of equal score make out the mean of their values, which here falls halfway
    between two bfloat16 numbers (truncation would give the lower, odd one)."""
    e = 2.0 ** -7
    v = torch.tensor([[[1 + e, -(1 + e), 3.0], [1 + 2 * e, -(1 + 2 * e), 3.0 + 32 * e]]])
    q = torch.zeros(1, 1, 3)
    k = torch.zeros(1, 2, 3)
    bf = torch.bfloat16
    out, _ = ops.flash_attn_fwd(q.to(bf), k.to(bf), v.to(bf), device=device)
    expected = v.to(bf).float().mean(dim=1, keepdim=True).to(bf)
    assert torch.equal(out, expected)
    assert out[0, 0, 0].item() == 1 + 2 * e


def test_dlpack_only_producer(ops, device):
    """Any object with __dlpack__ is read in place; its results come back as NumPy arrays."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 3, 20, 8)).astype(np.float32) for _ in range(3))
    out, lse = ops.flash_attn_fwd(DLPackOnly(q), DLPackOnly(k), DLPackOnly(v), device=device)
    expected, _ = ops.flash_attn_fwd(q, k, v, device=device)
    assert isinstance(out, np.ndarray)
    np.testing.assert_array_equal(out, expected)


class Versioned(DLPackOnly):
    """A producer that gives only DLPack 1.x tensors (a future one, which the array API lets
    refuse consumers that do not ask with max_version)."""

    def __dlpack__(self, *, max_version=None, **kw):
        if max_version is None or max_version[0] < 1:
            raise BufferError("this producer gives only versioned DLPack tensors")
        return self.array.__dlpack__(max_version=max_version, **kw)


class Unversioned(DLPackOnly):
    """A producer from before DLPack 1.0, whose __dlpack__ takes no max_version."""

    def __dlpack__(self, stream=None):
        return self.array.__dlpack__()


@pytest.mark.parametrize("producer", [Versioned, Unversioned])
def test_dlpack_versions(ops, producer):
    """orchard asks for a versioned tensor (max_version=(1, 0)) and reads an unversioned one
    from a producer that cannot give it; either way in place, and released after the call."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 2, 9, 8)).astype(np.float32) for _ in range(3))
    before = sys.getrefcount(k)
    ops.reset_stats()
    out, _ = ops.flash_attn_fwd(q, producer(k), v, device="cpu")
    assert ops.stats()["per_device"]["cpu"]["staged_buffers"] == 0
    np.testing.assert_array_equal(out, ops.flash_attn_fwd(q, k, v, device="cpu")[0])
    assert sys.getrefcount(k) == before     # the producer's deleter ran


def test_read_only_array_through_dlpack(ops):
    """NumPy exports a read-only array only as a versioned tensor (its flags say read-only):
    asked for unversioned ones, orchard refused it (NumPy's BufferError)."""
    q = np.random.default_rng(2).standard_normal((1, 2, 9, 8)).astype(np.float32)
    q.flags.writeable = False
    out, _ = ops.flash_attn_fwd(DLPackOnly(q), DLPackOnly(q), DLPackOnly(q), device="cpu")
    np.testing.assert_array_equal(out, ops.flash_attn_fwd(q, q, q, device="cpu")[0])


DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32),
                ("device_id", ctypes.c_int32), ("ndim", ctypes.c_int32),
                ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16),
                ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32),
                ("context", ctypes.c_void_p), ("deleter", DELETER),
                ("flags", ctypes.c_uint64), ("tensor", DLTensor)]


def capsule_producer(tensor):
    """(a producer whose __dlpack__ gives a versioned capsule of the ctypes struct tensor,
    that capsule)."""
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype, new_capsule.argtypes = ctypes.py_object, (
        ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
    capsule = new_capsule(ctypes.addressof(tensor), b"dltensor_versioned", None)

    class Producer:
        def __dlpack__(self, **kw):
            return capsule

    return Producer(), capsule


def test_dlpack_major_version_not_read(ops):
    """A versioned capsule of another major version (its tensor maybe laid out otherwise) is
    refused, naming the argument, and released through its deleter, which every version
    keeps in the same place (dlpack.h asks the consumer to call it)."""
    released = []
    deleter = DELETER(released.append)
    tensor = DLManagedTensorVersioned(major=2, minor=0, deleter=deleter)
    producer, capsule = capsule_producer(tensor)
    q = np.ones((1, 2, 4, 8), np.float32)
    with pytest.raises(ValueError, match="argument 'k': its __dlpack__\\(\\) gave a DLPack 2.0 "
                                         "tensor; orchard reads DLPack 1.x"):
        ops.flash_attn_fwd(q, producer, q)
    assert released == [ctypes.addressof(tensor)]
    assert "used_dltensor_versioned" in repr(capsule)


def test_dlpack_vector_lanes_are_named(ops):
    """float32 in vectors of 2 lanes (DLPack's lanes) is refused naming the lanes: the message
    read as if float32 itself were refused ("type code 2 with 32 bits")."""
    q = np.ones((1, 2, 4, 8), np.float32)
    shape = (ctypes.c_int64 * 4)(1, 2, 4, 4)
    deleter = DELETER(lambda _: None)
    tensor = DLManagedTensorVersioned(major=1, minor=0, deleter=deleter, tensor=DLTensor(
        data=q.ctypes.data, device_type=1, ndim=4, code=2, bits=32, lanes=2, shape=shape))
    producer, _ = capsule_producer(tensor)
    with pytest.raises(TypeError, match="argument 'k' must be a float16, .*, not DLPack type "
                                        "code 2 with 32 bits and 2 lanes"):
        ops.flash_attn_fwd(q, producer, q)


def test_dlpack_offset_past_the_address_space_is_refused(ops):
    """A byte_offset that wraps the data pointer around (a producer's error) is refused,
    naming the argument; the kernels read wherever it pointed (a segmentation fault)."""
    q = np.ones((1, 2, 4, 8), np.float32)
    shape = (ctypes.c_int64 * 4)(1, 2, 4, 8)
    deleter = DELETER(lambda _: None)
    for offset in (2**63, 2**64 - 64):
        tensor = DLManagedTensorVersioned(major=1, minor=0, deleter=deleter, tensor=DLTensor(
            data=q.ctypes.data, device_type=1, ndim=4, code=2, bits=32, lanes=1, shape=shape,
            byte_offset=offset))
        producer, _ = capsule_producer(tensor)
        with pytest.raises(ValueError, match="argument 'k' has DLPack byte_offset %d, past the "
                                             "end of the address space" % offset):
            ops.flash_attn_fwd(q, producer, q)


def test_strided_tensor_views_in_place(ops):
    """A (B, N, H, D) tensor seen as (B, H, N, D) is read through its strides, no copy, and
    the results are laid out as their operands (as torch's empty_like): seen back as
    (B, N, H, D) they are contiguous."""
    x = torch.randn(2, 50, 4, 16, dtype=torch.bfloat16)[:, 3:]
    q = x.transpose(1, 2)
    ops.reset_stats()
    out, lse = ops.flash_attn_fwd(q, q, q, device="cpu")
    assert ops.stats()["per_device"]["cpu"]["staged_buffers"] == 0
    assert out.transpose(1, 2).is_contiguous() and lse.is_contiguous()
    dq = ops.flash_attn_bwd(out, q, q, q, out, lse, device="cpu")[0]
    assert dq.transpose(1, 2).is_contiguous()
    expected, _ = ops.flash_attn_fwd(q.contiguous(), q.contiguous(), q.contiguous(),
                                     device="cpu")
    assert torch.equal(out, expected)


@pytest.mark.parametrize("sizes", [(3, 4, 7), (1, 4, 7), (2, 2, 2)])
def test_results_are_laid_out_as_torch_empty_like(ops, sizes):
    """out and the gradients have the strides torch's empty_like gives their operand, for
    every order of the leading axes and every set of them expanded (stride 0: sorted
    outermost by stride, an expanded batch axis had come innermost but for the last, so that
    out.view(3, -1) failed), in orchard_ops and in the torch layer's traced layout
    (attention_op._layout_order) alike."""
    import itertools

    from orchard.attention_op import _layout_order

    for perm in itertools.permutations(range(3)):
        for expanded in itertools.product((False, True), repeat=3):
            x = torch.randn(*[sizes[p] for p in perm], 8).permute(
                *[perm.index(i) for i in range(3)], 3)
            q = x[tuple(slice(0, 1) if e else slice(None) for e in expanded)].expand(x.shape)
            want = torch.empty_like(q).stride()
            out, lse = ops.flash_attn_fwd(q, q, q, device="cpu")
            dq = ops.flash_attn_bwd(out, q, q, q, out, lse, device="cpu")[0]
            assert out.stride() == dq.stride() == want, (perm, expanded, q.stride())
            assert torch.empty_permuted(q.shape, _layout_order(q)).stride() == want
            assert torch.equal(out, ops.flash_attn_fwd(*[q.contiguous()] * 3, device="cpu")[0])


def test_dlpack_errors(ops):
    """Device memory, unsupported dtypes, mixed dtypes and a NumPy uint16 array are refused,
    naming the argument."""
    q = torch.randn(1, 2, 4, 8)
    meta = torch.empty(1, 2, 4, 8, device="meta")
    with pytest.raises((ValueError, TypeError), match="'k'"):
        ops.flash_attn_fwd(q, meta, q)
    with pytest.raises(TypeError, match="argument 'v' must be a float16, float32, float64 or "
                                        "bfloat16 array"):
        ops.flash_attn_fwd(q, q, q.to(torch.int32))
    with pytest.raises(TypeError, match="argument 'k' has dtype bfloat16 but 'q' has float32"):
        ops.flash_attn_fwd(q, q.to(torch.bfloat16), q)
    with pytest.raises(TypeError, match="argument 'q' must be"):
        ops.flash_attn_fwd(q.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16), q, q)
    out, lse = ops.flash_attn_fwd(q.to(torch.bfloat16), q.to(torch.bfloat16), q.to(torch.bfloat16))
    with pytest.raises(TypeError, match="argument 'lse' has dtype bfloat16"):
        ops.flash_attn_bwd(out, q.to(torch.bfloat16), q.to(torch.bfloat16),
                           q.to(torch.bfloat16), out, lse.to(torch.bfloat16))


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")
def test_a_tensor_without_memory_is_refused(ops):
    """A DLPack tensor whose data pointer is NULL (a FakeTensor's) was given NumPy, which then
    allocated uninitialised memory for it: the kernels ran on garbage."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake, empty = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 0, 8)
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="argument 'k' has no memory"):
        ops.flash_attn_fwd(q, fake, q)
    out, lse = ops.flash_attn_fwd(q, q, q)
    with pytest.raises(ValueError, match="argument 'dout' has no memory"):
        ops.flash_attn_bwd(fake, q, q, q, out, lse)
    assert ops.flash_attn_fwd(empty, empty, empty)[0].shape == (1, 2, 0, 8)   # nothing to read


def test_dlpack_producer_errors_name_the_argument(ops):
    """__dlpack__ giving something other than an unused capsule is a TypeError naming the
    argument (not CPython's capsule message)."""
    q = np.ones((1, 2, 4, 8), np.float32)
    capsule = q.__dlpack__()

    class Producer:
        def __init__(self, given):
            self.given = given

        def __dlpack__(self, **kwargs):
            return self.given

    ops.flash_attn_fwd(q, Producer(capsule), q)     # a fresh capsule is read (and used up)
    for given in (5, capsule):
        with pytest.raises(TypeError, match="argument 'k': its __dlpack__\\(\\) gave"):
            ops.flash_attn_fwd(q, Producer(given), q)

    class NotCallable:
        __dlpack__ = 3

    class RaisingProperty:
        @property
        def __dlpack__(self):
            raise ValueError("no tensor here")

    # a __dlpack__ that cannot be called, or whose look-up fails, says which argument
    for producer, words in ((NotCallable(), "'int' object is not callable"),
                            (RaisingProperty(), "no tensor here")):
        with pytest.raises(TypeError, match="argument 'k' cannot be viewed as an array \\(%s"
                                            % words):
            ops.flash_attn_fwd(q, producer, q)


def call_with_a_stand_in_torch(tensor, extra=""):
    """flash_attn_fwd of DLPack producers (not NumPy arrays) while sys.modules["torch"] is a
    stand-in module: its Tensor the class that source `tensor` defines, then source `extra` run
    on it (`fake`); the call must give its result."""
    code = """if True:
        import gc, sys, types
        import numpy as np, orchard_ops
%s
        fake = types.ModuleType("torch")
        fake.Tensor = Tensor
        fake.to_dlpack = lambda t: np.ones((1, 2, 4), np.float32).__dlpack__()
        fake.from_numpy = lambda a: a
        fake.bfloat16 = None
%s
        sys.modules["torch"] = fake
        del fake
        class Producer:
            def __dlpack__(self, **kwargs):
                return np.ones((1, 2, 4), np.float32).__dlpack__()
        out, lse = orchard_ops.flash_attn_fwd(Producer(), Producer(), Producer())
        print(out.shape)
    """ % (tensor, extra)
    r = run_python(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "(1, 2, 4)"


def test_torch_module_dropped_during_the_tensor_check():
    # orchard holds its own references to sys.modules["torch"] and what it calls of it while it
    # asks whether an operand is a tensor (Python code runs then): here that code drops the
    # module (it crashed)
    call_with_a_stand_in_torch("""
        class Meta(type):
            def __instancecheck__(cls, obj):
                sys.modules.pop("torch", None)
                gc.collect()
                return True
        class Tensor(metaclass=Meta):
            view = lambda self, dtype: self""")


def test_torch_module_whose_autograd_cannot_be_read():
    """What only a write into a torch cache needs of torch (grad and inference mode, the
    version counters) is read as absent where it cannot be read (a lazy attribute that raises,
    a module without autograd): reading operands never depends on it."""
    call_with_a_stand_in_torch("""
        class Tensor:
            view = lambda self, dtype: self""", """
        def lazy(name):
            raise ImportError("lazy " + name)
        fake.__getattr__ = lazy""")


def test_torch_module_replaced_while_a_call_reads_a_tensor():
    """What orchard calls of torch stays alive through a call that, in the Python code the call
    runs (here a tensor subclass's is_neg), makes orchard read another torch module."""
    code = """if True:
        import sys, types, torch, orchard_ops
        seen = []
        class Odd(torch.Tensor):
            @classmethod
            def __torch_function__(cls, func, types_, args=(), kwargs=None):
                if func is torch.Tensor.is_neg and not seen:
                    sys.modules["torch"] = types.ModuleType("torch")
                    x = torch.ones(1, 2, 4, 8)
                    seen.append(type(orchard_ops.flash_attn_fwd(x, x, x)[0]).__name__)
                    sys.modules["torch"] = torch
                return super().__torch_function__(func, types_, args, kwargs or {})
        q = torch.ones(1, 2, 4, 8).as_subclass(Odd)
        out, lse = orchard_ops.flash_attn_fwd(q, q, q)
        print(*seen, type(out).__name__, float(out.sum()))
    """
    r = run_python(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["ndarray", "Tensor", "64.0"]


def test_torch_module_replaced_is_read_again():
    """orchard reads what it calls of torch once per module in sys.modules["torch"]: a module
    put in its place is read afresh (one without tensors gives NumPy results), and torch's
    back gives tensors again."""
    code = """if True:
        import sys, types
        import torch, orchard_ops
        q = torch.ones(1, 2, 4, 8)
        kinds = [type(orchard_ops.flash_attn_fwd(q, q, q)[0]).__name__]
        sys.modules["torch"] = types.ModuleType("torch")
        kinds.append(type(orchard_ops.flash_attn_fwd(q, q, q)[0]).__name__)
        sys.modules["torch"] = torch
        kinds.append(type(orchard_ops.flash_attn_fwd(q, q, q)[0]).__name__)
        print(*kinds)
    """
    r = run_python(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["Tensor", "ndarray", "Tensor"]
