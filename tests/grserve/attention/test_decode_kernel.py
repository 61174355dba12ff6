"""The C++ decode attention kernel (``attention/decode_kernel.py``) against SDPA, and its fallbacks.

The kernel is built for the running CPU by the test itself (``$GRSERVE_CACHE_DIR`` in a temporary directory where a
test needs a fresh build). Checked: outputs against ``reference_attend`` (SDPA with a key mask) for the shapes of
the presets and odd ones, fp32 and bf16, strided K/V as the staging buffer holds them, every key count from 1 to
past two blocks; a request's output is the same bits alone and beside others (it reads only its own keys) and on
one thread or two; every reason to fall back gives None and SDPA, and a serial build takes only one-thread steps.
Through the engine on one torch thread and on two: greedy tokens equal HF ``generate`` and the SDPA run (fp32),
per-step logits equal the gather path's (the tiny preset in bf16, eager and compiled, both through the kernel:
``tests/grserve/model/test_decode_compile.py``).
"""

from __future__ import annotations

import pytest
import torch

from grserve.attention import decode_kernel as dk
from grserve.attention.decode_staging import DecodeStaging
from grserve.engine.sampling import SamplingParams
from grserve.model.cpu_support import cpu_support
from grserve.model.thread_choice import openmp_runtime_path
from grserve.scheduler.llm_factory import make_llm_scheduler
from llm_fixtures import Preempting, run_joining

fast_only = pytest.mark.skipif(not cpu_support().fast_paths, reason="GRSERVE_CPU_ISA=reference: no kernel")
needs_compiler = pytest.mark.skipif(dk.compiler() is None, reason="no C++ compiler")


def _build(group: int, head_dim: int) -> tuple[dk.DecodeKernel | None, str]:
    """The kernel as the executor builds it (this machine, torch's OpenMP runtime)."""
    return dk.decode_kernel(group, head_dim, cpu_support().cpu_model, openmp_runtime_path())


def _kernel(group: int, head_dim: int) -> dk.DecodeKernel:
    kernel, why = _build(group, head_dim)
    assert kernel is not None, why
    return kernel


@fast_only
@needs_compiler
@pytest.mark.parametrize("group,head_dim", [(4, 32), (2, 64), (1, 128), (8, 128), (3, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_sdpa_on_the_staging_layout(group, head_dim, dtype):
    kernel = _kernel(group, head_dim)
    g = torch.Generator().manual_seed(group * 1000 + head_dim)
    s, hkv, t_cap = 19, 2, 64
    lens = torch.tensor([1, 2, 7, 8, 9, 15, 16, 17, 23, 24, 31, 33, 40, 47, 48, 50, 57, 63, 64])
    buf = torch.randn(2, s, hkv, t_cap, head_dim, generator=g).to(dtype)  # [K/V, S, Hkv, T_cap, d]: as staged
    k, v = buf[0], buf[1]
    q = torch.randn(s, hkv * group, head_dim, generator=g).to(dtype).view(s, hkv, group, head_dim)
    got = kernel.attend(q, k, v, lens)
    assert got.dtype == dtype and got.shape == q.shape
    want = dk.reference_attend(q.float(), k.float(), v.float(), lens)
    tol = 2e-6 if dtype == torch.float32 else 8e-3  # bf16: one rounding of the output
    assert float((got.float() - want).abs().max()) <= tol
    # keys past a request's length are never read: NaN there changes nothing
    k2 = k.clone()
    for i, n in enumerate(lens.tolist()):
        k2[i, :, n:] = float("nan")
    assert torch.equal(kernel.attend(q, k2, v, lens), got)


@fast_only
@needs_compiler
def test_a_request_gets_the_same_bits_alone_and_beside_others():
    kernel = _kernel(4, 32)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(6, 2, 4, 32, generator=g)
    k, v = torch.randn(2, 6, 2, 128, 32, generator=g)
    lens = torch.tensor([100, 3, 128, 57, 9, 64])
    batch = kernel.attend(q, k, v, lens)
    for i in range(6):
        alone = kernel.attend(q[i:i + 1], k[i:i + 1, :, :lens[i]], v[i:i + 1, :, :lens[i]], lens[i:i + 1])
        assert torch.equal(alone[0], batch[i])


@fast_only
@needs_compiler
def test_the_same_bits_on_one_thread_and_two():
    kernel = _kernel(2, 64)
    assert kernel.parallel == (openmp_runtime_path() is not None)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(9, 8, 2, 64, generator=g)
    k, v = torch.randn(2, 9, 8, 200, 64, generator=g)
    lens = torch.tensor([200, 1, 77, 150, 9, 64, 65, 199, 3])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.attend(q, k, v, lens)
        torch.set_num_threads(2)
        assert kernel.accepts(q, k) == kernel.parallel
        assert torch.equal(kernel.attend(q, k, v, lens), one)
    finally:
        torch.set_num_threads(before)


@fast_only
@needs_compiler
def test_a_serial_build_takes_only_one_thread_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("GRSERVE_CACHE_DIR", str(tmp_path))
    path, cached = dk._build(dk.compiler(), 2, 16, None)
    kernel = dk.DecodeKernel(path, 2, 16, 0.0, cached, parallel=False)
    assert dk.check(kernel) is None and "serial" in kernel.describe()
    q = torch.zeros(1, 1, 2, 16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert not kernel.accepts(q, q)
        torch.set_num_threads(1)
        assert kernel.accepts(q, q)
    finally:
        torch.set_num_threads(before)


@fast_only
@needs_compiler
def test_a_wrong_shape_is_refused():
    kernel = _kernel(4, 32)
    q, kv = torch.zeros(1, 2, 4, 32), torch.zeros(1, 2, 8, 32)
    with pytest.raises(ValueError, match="group 4"):
        kernel.attend(torch.zeros(1, 2, 2, 32), kv, kv, torch.tensor([8]))
    with pytest.raises(ValueError, match="group 4"):
        kernel.attend(q, torch.zeros(2, 2, 8, 32), kv, torch.tensor([8]))  # another request count
    for bad in (9, 0):  # past the keys held, or none: refused before the C++ side reads anything
        with pytest.raises(ValueError, match="lens must lie"):
            kernel.attend(q, kv, kv, torch.tensor([bad]))
    assert kernel.attend(q, kv, kv, torch.tensor([8])).shape == q.shape
    assert not kernel.accepts(torch.zeros(1, dtype=torch.float16), torch.zeros(1, dtype=torch.float16))
    assert not kernel.accepts(torch.zeros(1), torch.zeros(1, dtype=torch.bfloat16))


def test_every_reason_to_fall_back_gives_sdpa(monkeypatch, tmp_path):
    monkeypatch.setenv("GRSERVE_CACHE_DIR", str(tmp_path))
    dk.decode_kernel.cache_clear()
    try:
        kernel, why = _build(4, 36)
        assert kernel is None and "no kernel" in why  # head dim not 8k
        kernel, why = _build(17, 32)
        assert kernel is None and "no kernel" in why
        with monkeypatch.context() as mp:  # $CXX missing and nothing on the PATH
            mp.setenv("CXX", str(tmp_path / "no-such-compiler"))
            mp.setenv("PATH", str(tmp_path))
            kernel, why = _build(4, 32)
            assert kernel is None and why == "no C++ compiler"
            dk.decode_kernel.cache_clear()
        if dk.compiler() is None:
            return
        broken = tmp_path / "broken.cpp"
        broken.write_text("this is not C++\n")
        monkeypatch.setattr(dk, "SOURCE", broken)
        kernel, why = _build(4, 32)
        assert kernel is None and "failed" in why
        dk.decode_kernel.cache_clear()
        monkeypatch.undo()
        monkeypatch.setenv("GRSERVE_CACHE_DIR", str(tmp_path))
        # a kernel that builds but disagrees with SDPA is not used
        monkeypatch.setattr(dk, "reference_attend", lambda q, k, v, lens: torch.zeros_like(q))
        kernel, why = _build(4, 32)
        assert kernel is None and "disagrees" in why
    finally:
        dk.decode_kernel.cache_clear()


@fast_only
@needs_compiler
def test_the_build_is_cached_across_restarts(monkeypatch, tmp_path):
    monkeypatch.setenv("GRSERVE_CACHE_DIR", str(tmp_path))
    dk.decode_kernel.cache_clear()
    try:
        first = _kernel(2, 16)
        assert not first.cached and "built in" in first.describe()
        assert len(list((tmp_path / "kernels").glob("decode_attend_g2_d16_*.so"))) == 1
        dk.decode_kernel.cache_clear()  # a restart
        again = _kernel(2, 16)
        assert again.cached and "from the cache" in again.describe()
    finally:
        dk.decode_kernel.cache_clear()


VOCAB = 300


@fast_only
@needs_compiler
@pytest.mark.parametrize("sched,threads", [("fcfs", 1), ("preempting", 1), ("fcfs", 2)])
def test_engine_uses_the_kernel_and_equals_hf(hf_qwen3, sched, threads):
    hf, ours = hf_qwen3(kv_heads=2, seed=5, perturb_norms=True)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, VOCAB, (int(n),), generator=gen).tolist()
               for n in torch.randint(3, 20, (7,), generator=gen)]
    params = [SamplingParams(max_tokens=int(m), temperature=0.0, ignore_eos=True)
              for m in torch.randint(3, 15, (7,), generator=gen)]
    calls = []
    real = dk.DecodeKernel.attend

    def counted(self, *a):
        calls.append(1)
        return real(self, *a)

    runs = {}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    for kernel in (True, False):
        policy = make_llm_scheduler("fcfs")
        policy = Preempting(policy) if sched == "preempting" else policy
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(dk.DecodeKernel, "attend", counted)
            runs[kernel], eng = run_joining(ours, policy, prompts, params, decode_kernel=kernel)
        assert (eng.executor.staging.kernel is not None) == kernel
        assert ("C++ decode kernel" in eng.executor.describe()) == kernel
        assert (len(calls) > 0) == (kernel and (eng.executor.staging.kernel.parallel or threads == 1))
        calls.clear()
    torch.set_num_threads(before)
    assert runs[True] == runs[False]
    for p, sp, got in zip(prompts, params, runs[True]):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=sp.max_tokens, min_new_tokens=sp.max_tokens, do_sample=False,
                              pad_token_id=0)[0, len(p):].tolist()
        assert got == ref


@fast_only
@needs_compiler
def test_staged_logits_with_the_kernel_equal_the_gather_path(hf_qwen3, one_thread):
    """The staged context's per-step logits with the kernel against the unstaged (gather + SDPA) context's."""
    from test_decode_staging import staged_run_logits

    _, ours = hf_qwen3(kv_heads=2, seed=5, perturb_norms=True)
    spec = ours.spec
    kernel = _kernel(spec.num_attention_heads // spec.num_key_value_heads, spec.head_dim)
    staging = DecodeStaging(spec.num_hidden_layers, spec.num_key_value_heads, spec.head_dim, kernel=kernel)
    calls = []
    real = kernel.attend
    kernel.attend = lambda *a: calls.append(1) or real(*a)
    try:
        staged = staged_run_logits(ours, staging)
    finally:
        del kernel.attend
    assert len(calls) >= 4 * spec.num_hidden_layers
    for a, b in zip(staged_run_logits(ours, None), staged):
        assert float((a - b).abs().max()) <= 1e-5


@fast_only
@needs_compiler
def test_key_lengths_are_a_private_copy_checked_once():
    kernel = _kernel(4, 32)
    q, kv = torch.zeros(2, 2, 4, 32), torch.zeros(2, 2, 8, 32)
    lens = torch.tensor([8, 3])
    held = dk.KeyLengths(lens)
    lens[1] = 9  # the caller's tensor changes; the checked copy does not
    assert held.longest == 8 and kernel.attend(q, kv, kv, held).shape == q.shape
    with pytest.raises(ValueError, match="lens must lie"):
        kernel.attend(q, kv, kv, lens)
    with pytest.raises(ValueError, match="no keys"):
        dk.KeyLengths(torch.tensor([0, 3]))
