"""The weight paths side by side (``BENCH_ONLY=native make bench``, or section ``native``): SmolLM2 served
``native`` (its GGUF blocks through the block kernels), ``float32`` and ``bfloat16``, one stack each, all up at
once and measured in alternating rounds (BENCH_ROUNDS; the median pair kept for each ratio):
- the CPU model and its vector extensions, and the copy bandwidth;
- one stream through gRPC: ITL p50 for each path, and native's ratio to its floor (the file's bytes read per
  token ÷ the copy bandwidth); against llama-server also in BENCH_SOLO_PAIRS (9) adjacent pairs, one request
  of each system back to back, whose median ratio is the target's (this machine's speed drifts within a
  round); speculative decoding is off here (it delivers several tokens a step, which is
  its own section): these rows compare the weight paths, one forward per token as llama-server runs;
- 32 and 64 streams: tokens/s native, float32 and (where the CPU has AVX-512 BF16) bfloat16, with transformers'
  raw fp32 decode loop at batch 32;
- the prefill of a 2,000-token prompt (TTFT of one request, 1 output token), the same paths;
- each generation worker's RSS while serving (ListModels' measured memory);
- the CPU time each process spends per token of the one-stream runs (native through gRPC: worker, engine,
  router, this client; llama-server and this client): on two cores a stream's ITL cannot be less than what its
  processes spend per token, halved;
- when `make bench-peers` has built it, llama.cpp's llama-server on the same GGUF (32 slots), in the same
  rounds: one stream's ITL, 32 streams and the 2,000-token prefill through the same OpenAI HTTP client
  (streamed /v1/completions) as llmserve native's HTTP rows (its router's OpenAI face).
On CPUs without AVX-512 BF16 torch emulates bfloat16, and it runs only the one-stream row.
"""
from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path
from typing import Callable

import grpc
import torch
from transformers import AutoModelForCausalLM

from bench import mixed
from bench.load import pct, run_streams
from bench.online import completion_stream, llama_server
from llmserve.v1 import llm_pb2, llm_pb2_grpc
from services.common.model_source import resolve_model
from services.engine.models.tokenizer import Tokenizer
from services.worker import kernels
from services.stack import start_stack
from services.worker.gguf_weights import GGUFWeights
from services.worker.model_loader import ensure_safetensors

ROUNDS = int(os.environ.get("BENCH_ROUNDS", 3))
# one-stream pairs for the llama-server ratio: native gRPC, native HTTP and llama-server one request each, back to
# back (the order reversed every other pair), so that each ratio compares requests seconds apart
SOLO_PAIRS = int(os.environ.get("BENCH_SOLO_PAIRS", 9))
TOKENS = int(os.environ.get("BENCH_TOKENS", 128))
LONG_TOKENS = 2000
LLAMA_SERVER = Path(os.environ.get("LLAMA_SERVER", ".cache/peers/llama-server"))


def cpu_line() -> str:
    info = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), "unknown CPU")
    flags = set(next((ln.split(":", 1)[1].split() for ln in info if ln.startswith("flags")), []))
    have = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]
    return f"{model}, {os.cpu_count()} cores; {', '.join(have)}"


def gguf_tensor_bytes(path: Path) -> int:
    """The bytes of a GGUF's tensors as stored: what a native decode step reads."""
    weights = GGUFWeights(path)
    try:
        return sum(int(t.n_bytes) for t in weights.tensors.values())
    finally:
        weights.close()


class Served:
    def __init__(self, dtype: str):
        self.dtype = dtype
        self.stack = start_stack(["--model", "smollm2", "--dtype", dtype, "--max-num-seqs", "32",
                                  "--kv-cache-mb", "1024", "--speculative-method", "none"],
                                 http_port=0 if dtype == "native" else -1,
                                 log_dir=Path(tempfile.mkdtemp(prefix=f"bench-{dtype}-")))
        self.channel = grpc.insecure_channel(self.stack.router.address)
        self.stub = llm_pb2_grpc.LLMServiceStub(self.channel)
        list(self.stream("warm up", 4))

    def stream(self, prompt: str, max_tokens: int = TOKENS):  # type: ignore[no-untyped-def]
        sampling = llm_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for msg in self.stub.GenerateStream(llm_pb2.GenerateRequest(prompt=prompt, sampling=sampling), timeout=900):
            yield len(msg.token_ids)

    def itl(self, prompt: str) -> float:
        return pct(run_streams(self.dtype, [prompt], self.stream).itl, 50)

    def tokens_per_s(self, prompts: list[str]) -> float:
        return run_streams(self.dtype, prompts, self.stream).tokens_per_s

    def prefill(self, prompt: str) -> float:
        return run_streams(self.dtype, [prompt], lambda p: self.stream(p, 1)).ttft[0]

    def rss_mib(self) -> float:
        models = self.stub.ListModels(llm_pb2.ListModelsRequest(), timeout=30).models
        return max(m.memory_bytes for m in models) / 2**20

    def close(self) -> None:
        self.channel.close()
        self.stack.stop()


class OverHttp:
    """A system through the OpenAI HTTP face (streamed /v1/completions), the same client for each."""

    def __init__(self, label: str, url: str):
        self.dtype, self.url = label, url
        list(self.stream("warm up", 4))

    def stream(self, prompt: str, max_tokens: int = TOKENS):  # type: ignore[no-untyped-def]
        return completion_stream(self.url, prompt, max_tokens)

    itl, tokens_per_s, prefill = Served.itl, Served.tokens_per_s, Served.prefill


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used (/proc/PID/stat, every thread)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):   # a process that ended while we looked
            continue
    return out


def cpu_times(pids: dict[str, int]) -> dict[str, float]:
    return {name: cpu_seconds(pid) for name, pid in pids.items()}


def paired(ours: list[float], theirs: list[float]) -> str:
    """The median of the rounds' ratios ours / theirs, and every round's."""
    pairs = [a / b for a, b in zip(ours, theirs)]
    return f"{statistics.median(pairs):.2f} (pairs " + ", ".join(f"{x:.2f}" for x in pairs) + ")"


def rows(prompts: list[str], raw_decode: Callable[[torch.nn.Module, object, int], tuple[float, float, float]]
         ) -> list[str]:
    """The rows, printed as each round ends; ``raw_decode``: the ceiling's decode loop (bench/__main__.py)."""
    source = resolve_model("smollm2")
    file_bytes = gguf_tensor_bytes(source.path)
    long_prompt = " ".join(prompts * 40)
    tok = Tokenizer(source).hf    # converted from the GGUF on a fresh clone
    long_prompt = tok.decode(tok(long_prompt)["input_ids"][:LONG_TOKENS])
    lines = [f"CPU: {cpu_line()}; GGUF block kernels: {kernels.quant_isa()} build"]
    bf16 = kernels.cpu_supported()      # the bfloat16 kernels run (AVX-512 BF16): bf16 joins the wide rows
    served = {d: Served(d) for d in ("native", "float32", "bfloat16")}
    http: dict[str, OverHttp] = {}
    peer = None
    try:
        http["native HTTP"] = OverHttp("native HTTP", f"http://{served['native'].stack.http_address}/v1/completions")
        if LLAMA_SERVER.exists():
            peer, url = llama_server(LLAMA_SERVER, source.path, slots=32)
            http["llama-server HTTP"] = OverHttp("llama-server HTTP", url)
        systems = {**served, **http}
        wide = ("native", "float32", *(("bfloat16",) if bf16 else ()), *http)
        solo: dict[str, list[float]] = {d: [] for d in systems}
        stack = served["native"].stack
        cpu_pids = {"native": {"worker": child_pids(stack.engines[0].proc.pid)[0], "engine": stack.engines[0].proc.pid,
                               "router": stack.router.proc.pid, "client": os.getpid()}}
        if peer is not None:
            cpu_pids["llama-server HTTP"] = {"llama-server": peer.pid, "client": os.getpid()}
        cpu: dict[str, list[dict[str, float]]] = {d: [] for d in cpu_pids}
        many: dict[str, list[float]] = {d: [] for d in wide}
        many64: dict[str, list[float]] = {d: [] for d in wide}
        pre: dict[str, list[float]] = {d: [] for d in wide}
        for r in range(ROUNDS):
            for d, s in systems.items():
                before = cpu_times(cpu_pids.get(d, {}))
                solo[d].append(s.itl(prompts[r % len(prompts)]))
                if d in cpu_pids:   # each process's CPU seconds per token of that stream
                    cpu[d].append({n: (t - before[n]) / TOKENS for n, t in cpu_times(cpu_pids[d]).items()})
            for d in many:
                many[d].append(systems[d].tokens_per_s(prompts[:32]))
                many64[d].append(systems[d].tokens_per_s(prompts[:64]))
                pre[d].append(systems[d].prefill(f"{r} {d} " + long_prompt))   # unique: no prefix cache hit
            print(f"native round {r}: ITL ms " + ", ".join(f"{d} {v[-1] * 1e3:.1f}" for d, v in solo.items())
                  + "; 32 streams tok/s " + ", ".join(f"{d} {v[-1]:.0f}" for d, v in many.items())
                  + "; 64 streams tok/s " + ", ".join(f"{d} {v[-1]:.0f}" for d, v in many64.items())
                  + "; 2,000-token prefill s " + ", ".join(f"{d} {v[-1]:.2f}" for d, v in pre.items()), flush=True)
        adjacent: dict[str, list[float]] = {d: [] for d in ("native", "native HTTP", "llama-server HTTP")}
        if "llama-server HTTP" in http:
            for i in range(SOLO_PAIRS):
                order = list(adjacent) if i % 2 == 0 else list(reversed(adjacent))
                for d in order:
                    adjacent[d].append(systems[d].itl(prompts[(i + 3) % len(prompts)]))
                print(f"native one-stream pair {i}: ITL ms " + ", ".join(f"{d} {v[-1] * 1e3:.2f}" for d, v in
                                                                          adjacent.items()), flush=True)
        rss = {d: s.rss_mib() for d, s in served.items()}
    finally:
        for s in served.values():
            s.close()
        if peer is not None:
            peer.terminate()
            peer.wait(timeout=30)
    model = AutoModelForCausalLM.from_pretrained(ensure_safetensors(source), dtype=torch.float32).eval()
    raw32 = raw_decode(model, tok, 32)[0]
    del model
    bandwidth = mixed.stream_bandwidth()
    floor = file_bytes / bandwidth
    med = statistics.median
    ratio = [n / f for n, f in zip(solo["float32"], solo["native"])]
    lines += [
        f"copy bandwidth {bandwidth / 1e9:.1f} GB/s; native bytes per token {file_bytes / 1e6:.1f} MB: floor "
        f"{floor * 1e3:.2f} ms a token",
        "",
        "| path | 1 stream ITL p50 ms | × native floor | 32 streams tok/s | 64 streams tok/s | 2,000-token prefill s "
        "| worker RSS MiB |",
        "|---|---|---|---|---|---|---|"]
    for d in systems:
        itl = med(solo[d])
        lines.append(f"| {d} | {itl * 1e3:.1f} | {itl / floor:.1f} | {med(many[d]):.0f} | {med(many64[d]):.0f} | "
                     f"{med(pre[d]):.2f} | {rss.get(d, float('nan')):.0f} |" if d in many else
                     f"| {d} | {itl * 1e3:.1f} | {itl / floor:.1f} | – | – | – | {rss.get(d, float('nan')):.0f} |")
    lines.append(f"| raw transformers fp32 decode loop | – | – | {raw32:.0f} | – | – |")
    lines += [
        "",
        f"- one stream: float32 ITL / native ITL {med(ratio):.2f} (median pair; pairs "
        + ", ".join(f"{x:.2f}" for x in ratio) + ")",
        f"- 32 streams: native / float32 {med([n / f for n, f in zip(many['native'], many['float32'])]):.2f}; "
        f"native / raw fp32 decode loop {med(many['native']) / raw32:.2f}",
        f"- 2,000-token prefill: float32 time / native time "
        f"{med([f / n for n, f in zip(pre['native'], pre['float32'])]):.2f}",
    ]
    if bf16:
        lines += [
            f"- native / bfloat16 tokens/s: 32 streams {paired(many['native'], many['bfloat16'])}; 64 streams "
            f"{paired(many64['native'], many64['bfloat16'])} (target >= 1.0)",
            f"- 2,000-token prefill, bfloat16 time / native time {paired(pre['bfloat16'], pre['native'])} "
            "(target >= 0.9)",
        ]
    cores = os.cpu_count() or 1
    for d, rounds in cpu.items():
        per = {name: med([r[name] for r in rounds]) for name in rounds[0]}
        total = sum(per.values())
        lines.append(f"- one stream, {d}: CPU per token (ms, medians of the rounds) "
                     + ", ".join(f"{name} {v * 1e3:.2f}" for name, v in per.items())
                     + f"; sum {total * 1e3:.2f}, over {cores} cores {total / cores * 1e3:.2f} against its ITL "
                     f"{med(solo[d]) * 1e3:.2f}")
    if "llama-server HTTP" in http:
        peer_solo, peer_many, peer_pre = solo["llama-server HTTP"], many["llama-server HTTP"], pre["llama-server HTTP"]
        adj_peer = adjacent["llama-server HTTP"]
        lines += [
            f"- one stream, native ITL / llama-server ITL, {SOLO_PAIRS} adjacent pairs (one request each, back to "
            f"back): gRPC {paired(adjacent['native'], adj_peer)}; OpenAI HTTP {paired(adjacent['native HTTP'], adj_peer)}"
            f" (target <= 0.7); ITL p50 medians native {med(adjacent['native']) * 1e3:.2f}, native HTTP "
            f"{med(adjacent['native HTTP']) * 1e3:.2f}, llama-server {med(adj_peer) * 1e3:.2f} ms",
            f"- the same from the rounds' ITL above (seconds apart): gRPC {paired(solo['native'], peer_solo)}; OpenAI "
            f"HTTP {paired(solo['native HTTP'], peer_solo)}",
            f"- 32 streams, native / llama-server tokens/s: gRPC {paired(many['native'], peer_many)}; OpenAI HTTP "
            f"{paired(many['native HTTP'], peer_many)} (target >= 3)",
            f"- 2,000-token prefill, llama-server time / native time: {paired(peer_pre, pre['native'])}",
        ]
    else:
        lines.append("- llama-server not built (`make bench-peers`): no peer rows")
    return lines


