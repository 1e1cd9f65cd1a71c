"""`llmserve` command: a client of a running llmserve over gRPC.

The public API (generate, chat, models, predict) goes to ``$LLMSERVE_ADDR`` (a router or an engine;
default localhost:50051). Model loading and load reports are EngineAdmin, which engines serve
(routers do not): ``load``/``unload`` go to ``--admin-addr`` / ``$LLMSERVE_ADMIN_ADDR`` (default
localhost:50052); ``top`` shows those engines and every engine the router lists a model on.
A failed call prints its gRPC status and the server's message and exits 1, without a traceback.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable, Iterable

import grpc

from llmserve.v1 import engine_admin_pb2, engine_admin_pb2_grpc, llm_pb2, llm_pb2_grpc

DEFAULT_ADDR = "localhost:50051"
DEFAULT_ADMIN_ADDR = "localhost:50052"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llmserve", description="llmserve's command-line client (gRPC).")
    p.add_argument("--addr", default=os.environ.get("LLMSERVE_ADDR", DEFAULT_ADDR),
                   help="router (or engine) host:port; default $LLMSERVE_ADDR or %(default)s")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one call may take (default %(default)s)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def sampling_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--model", default="", help="model name or id (default: the server's default model)")
        sp.add_argument("--max-tokens", type=int, help="tokens to generate")
        sp.add_argument("--temperature", type=float, help="0 = greedy")
        sp.add_argument("--seed", type=int)
        constraint = sp.add_mutually_exclusive_group()
        constraint.add_argument("--json-schema", metavar="FILE", type=_file_text,
                                help="the output is JSON valid against the JSON Schema in FILE")
        constraint.add_argument("--json-object", action="store_true", help="the output is a JSON object")
        constraint.add_argument("--regex", help="the output matches this regular expression")
        constraint.add_argument("--choice", action="append", metavar="TEXT",
                                help="the output is one of these (repeat the flag: --choice yes --choice no)")
        constraint.add_argument("--grammar", metavar="FILE", type=_file_text,
                                help="the output follows the Lark (or GBNF) grammar in FILE")
        sp.add_argument("-v", "--verbose", action="store_true",
                        help="print the request id, the engine that served it, queue time and TTFT to stderr")

    g = sub.add_parser("generate", help="complete a prompt")
    g.add_argument("prompt")
    g.add_argument("--stream", action="store_true", help="print the text as it is generated")
    sampling_args(g)
    c = sub.add_parser("chat", help="chat: one user message per line of stdin, replies streamed, until EOF")
    c.add_argument("--system", default="", help="a system message to start with")
    sampling_args(c)
    sub.add_parser("models", help="the models, their task and where they are loaded")
    pr = sub.add_parser("predict", help="run a model on one input for its task (classification, embedding, text)")
    pr.add_argument("model")
    pr.add_argument("text")
    for name, what in (("load", "load a model on an engine now"), ("unload", "unload a model from an engine")):
        sp = sub.add_parser(name, help=what)
        sp.add_argument("model")
        sp.add_argument("--admin-addr", default=os.environ.get("LLMSERVE_ADMIN_ADDR", DEFAULT_ADMIN_ADDR),
                        help="engine host:port (EngineAdmin); default $LLMSERVE_ADMIN_ADDR or %(default)s")
    t = sub.add_parser("top", help="every engine's live load, refreshed")
    t.add_argument("--admin-addr", default=os.environ.get("LLMSERVE_ADMIN_ADDR", DEFAULT_ADMIN_ADDR),
                   help="engines to show (comma-separated), besides those the router lists; "
                        "default $LLMSERVE_ADMIN_ADDR or %(default)s")
    t.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    t.add_argument("--iterations", type=int, default=0, help="stop after this many screens (0 = until Ctrl-C)")
    t.add_argument("--once", action="store_true", help="one screen, then exit (= --iterations 1)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        COMMANDS[args.command](args)
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None  # type: ignore[attr-defined]
        details = exc.details() if hasattr(exc, "details") else str(exc)  # type: ignore[attr-defined]
        target = getattr(args, "admin_addr", None) if args.command in ("load", "unload") else args.addr
        print(f"llmserve {args.command}: {code.name if code else 'ERROR'}: {details} (server {target})",
              file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)


# -- commands --------------------------------------------------------------------------------


def _stub(args: argparse.Namespace) -> llm_pb2_grpc.LLMServiceStub:
    return llm_pb2_grpc.LLMServiceStub(grpc.insecure_channel(args.addr))


def _sampling(args: argparse.Namespace) -> llm_pb2.SamplingParams:
    s = llm_pb2.SamplingParams()
    if args.max_tokens is not None:
        s.max_tokens = args.max_tokens
    if args.temperature is not None:
        s.temperature = args.temperature
    if args.seed is not None:
        s.seed = args.seed
    if args.json_schema is not None:
        s.json_schema = args.json_schema
    if args.json_object:
        s.json_object = True
    if args.regex is not None:
        s.regex = args.regex
    if args.choice:
        s.choice.extend(args.choice)
    if args.grammar is not None:
        s.grammar = args.grammar
    return s


def _file_text(path: str) -> str:
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc}") from None


def _report(args: argparse.Namespace, metadata: Iterable[tuple[str, str]] | None) -> None:
    if args.verbose:
        for key, value in metadata or ():
            if key.startswith("x-llmserve-"):
                print(f"{key[len('x-llmserve-'):]}: {value}", file=sys.stderr)


def _stream(args: argparse.Namespace, request: llm_pb2.GenerateRequest) -> str:
    call = _stub(args).GenerateStream(request, timeout=args.timeout)
    parts = []
    for msg in call:
        sys.stdout.write(msg.text)
        sys.stdout.flush()
        parts.append(msg.text)
    _report(args, call.trailing_metadata())
    return "".join(parts)


def cmd_generate(args: argparse.Namespace) -> None:
    request = llm_pb2.GenerateRequest(model=args.model, prompt=args.prompt, sampling=_sampling(args))
    if args.stream:
        _stream(args, request)
    else:
        resp, call = _stub(args).Generate.with_call(request, timeout=args.timeout)
        sys.stdout.write(resp.text)
        _report(args, call.trailing_metadata())
    sys.stdout.write("\n")


def cmd_chat(args: argparse.Namespace) -> None:
    messages = [llm_pb2.ChatMessage(role="system", content=args.system)] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            break
        if not line.strip():
            continue
        messages.append(llm_pb2.ChatMessage(role="user", content=line.rstrip("\n")))
        reply = _stream(args, llm_pb2.GenerateRequest(model=args.model, messages=messages, sampling=_sampling(args)))
        sys.stdout.write("\n")
        sys.stdout.flush()
        messages.append(llm_pb2.ChatMessage(role="assistant", content=reply))


def cmd_models(args: argparse.Namespace) -> None:
    models = _stub(args).ListModels(llm_pb2.ListModelsRequest(), timeout=args.timeout).models
    rows = [("NAME", "TASK", "FORMAT", "LOADED", "MEMORY", "LOADED ON")]
    for m in models:
        rows.append((m.name, m.task, m.format, "yes" if m.loaded else "no", _mib(m.memory_bytes),
                     ",".join(m.loaded_on) or "-"))
    _table(rows)


def cmd_predict(args: argparse.Namespace) -> None:
    resp = _stub(args).Predict(llm_pb2.PredictRequest(model_id=args.model, input_data=args.text), timeout=args.timeout)
    kind = resp.WhichOneof("result")
    if kind == "classification":
        _table([("LABEL", "SCORE"), *((lb.label, f"{lb.score:.4f}") for lb in resp.classification.labels)])
    elif kind == "embedding":
        values = resp.embedding.values
        print(f"embedding, {resp.embedding.dimension} dimensions: [" + ", ".join(f"{v:.5f}" for v in values) + "]")
    else:
        print(resp.text)


def _admin(address: str) -> engine_admin_pb2_grpc.EngineAdminStub:
    return engine_admin_pb2_grpc.EngineAdminStub(grpc.insecure_channel(address))


def cmd_load(args: argparse.Namespace) -> None:
    resp = _admin(args.admin_addr).LoadModel(engine_admin_pb2.LoadModelRequest(model=args.model), timeout=args.timeout)
    if resp.was_loaded:
        print(f"{resp.model.name} was already loaded on {args.admin_addr}")
    else:
        evicted = f"; evicted {', '.join(resp.evicted)}" if resp.evicted else ""
        print(f"loaded {resp.model.name} on {args.admin_addr} in {resp.load_seconds:.2f}s "
              f"({_mib(resp.model.memory_bytes)}){evicted}")


def cmd_unload(args: argparse.Namespace) -> None:
    resp = _admin(args.admin_addr).UnloadModel(engine_admin_pb2.UnloadModelRequest(model=args.model),
                                               timeout=args.timeout)
    if resp.was_loaded:
        print(f"unloaded {resp.model.name} from {args.admin_addr}, freed {_mib(resp.freed_bytes)}")
    else:
        print(f"{resp.model.name} was not loaded on {args.admin_addr}")


def cmd_top(args: argparse.Namespace) -> None:
    from services.cli.top import run_top

    iterations = 1 if args.once else args.iterations
    run_top(_stub(args), [a.strip() for a in args.admin_addr.split(",") if a.strip()], args.interval, iterations,
            min(args.timeout, 5.0))


COMMANDS: dict[str, Callable[[argparse.Namespace], None]] = {
    "generate": cmd_generate, "chat": cmd_chat, "models": cmd_models, "predict": cmd_predict,
    "load": cmd_load, "unload": cmd_unload, "top": cmd_top,
}


# -- output ----------------------------------------------------------------------------------


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n else "-"


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


if __name__ == "__main__":
    main()
