"""The `phalanx` command."""

from __future__ import annotations

import asyncio
import json
import logging
import signal

import typer

app = typer.Typer(help="Phalanx: LLM inference that keeps serving through failures.", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks that print JSON and compare side by side in one run.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


@app.command()
def worker(
    worker_id: str = typer.Option("", help="Unique worker id (default: <hostname>-<pid>)"),
    host: str = typer.Option(None, help="Bind address [env PHALANX_WORKER_HOST]"),
    port: int = typer.Option(None, help="gRPC port, 0 for any [env PHALANX_WORKER_PORT]"),
    model: str = typer.Option(None, help="Built-in model or HF checkpoint dir [env PHALANX_ENGINE_MODEL]"),
    deterministic: bool = typer.Option(None, "--deterministic/--fast", help="Batch-invariant numerics"),
    nats_url: str = typer.Option(None, help="NATS URL [env PHALANX_NATS_URL]"),
    etcd_endpoint: str = typer.Option(None, help="etcd host:port [env PHALANX_ETCD_ENDPOINT]"),
    log_level: str = typer.Option("INFO"),
) -> None:
    """Run one engine worker: gRPC WorkerService, etcd lease, NATS load and KV events."""
    from phalanx.common.config import EtcdConfig, NatsConfig, TelemetryConfig
    from phalanx.worker.config import EngineConfig, WorkerConfig
    from phalanx.worker.process import WorkerProcess

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    process = WorkerProcess(
        WorkerConfig(**_given(worker_id=worker_id, host=host, port=port)),
        EngineConfig(**_given(model=model, deterministic=deterministic)),
        NatsConfig(**_given(url=nats_url)),
        EtcdConfig(**_given(endpoint=etcd_endpoint)),
        TelemetryConfig(),
    )
    _run_until_signalled(process)


@app.command()
def router(
    router_id: str = typer.Option("", help="Unique router id (default: router-<hostname>-<pid>)"),
    host: str = typer.Option(None, help="Bind address [env PHALANX_ROUTER_HOST]"),
    port: int = typer.Option(None, help="gRPC port, 0 for any [env PHALANX_ROUTER_PORT]"),
    model: str = typer.Option(None, help="Checkpoint directory for the tokenizer (default: the workers' built-in model)"),
    nats_url: str = typer.Option(None, help="NATS URL [env PHALANX_NATS_URL]"),
    etcd_endpoint: str = typer.Option(None, help="etcd host:port [env PHALANX_ETCD_ENDPOINT]"),
    log_level: str = typer.Option("INFO"),
) -> None:
    """Run a router: the public RouterService with KV-aware routing and resumable streams."""
    from phalanx.common.config import EtcdConfig, NatsConfig, TelemetryConfig
    from phalanx.router.config import RouterConfig
    from phalanx.router.process import RouterProcess

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    process = RouterProcess(
        RouterConfig(**_given(router_id=router_id, host=host, port=port, model=model)),
        NatsConfig(**_given(url=nats_url)),
        EtcdConfig(**_given(endpoint=etcd_endpoint)),
        TelemetryConfig(),
    )
    _run_until_signalled(process)


def _given(**values):
    """Options given on the command line; the rest come from env vars or defaults."""
    return {k: v for k, v in values.items() if v not in (None, "")}


def _run_until_signalled(process) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, process.request_stop)
        await process.run()

    asyncio.run(main())


@app.command()
def up(
    workers: int = typer.Option(2, min=1, max=16, help="Workers of the built-in model"),
    model: str = typer.Option("phalanx-tiny-moe", help="Built-in model or HF checkpoint directory"),
    deterministic: bool = typer.Option(True, "--deterministic/--fast", help="Batch-invariant numerics"),
    nats_url: str = typer.Option(None, envvar="PHALANX_NATS_URL", help="External NATS (default: start one)"),
    etcd_endpoint: str = typer.Option(None, envvar="PHALANX_ETCD_ENDPOINT", help="External etcd (default: start one)"),
) -> None:
    """Bring Phalanx up on this machine: embedded NATS and etcd plus supervised workers."""
    from rich.console import Console

    from phalanx.cli.up import run_up

    code = asyncio.run(
        run_up(workers=workers, model=model, deterministic=deterministic, nats_url=nats_url, etcd_endpoint=etcd_endpoint, console=Console())
    )
    raise typer.Exit(code)


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="Prompt text"),
    target: str = typer.Option(..., help="Worker address host:port (the router comes with the next release)"),
    max_tokens: int = typer.Option(32),
    temperature: float = typer.Option(0.0),
) -> None:
    """Stream a completion from a worker."""
    import grpc

    from phalanx._proto import common_pb2, worker_pb2, worker_pb2_grpc

    async def main() -> None:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            request = worker_pb2.GenerateRequest(
                text=prompt, sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature)
            )
            try:
                async for chunk in stub.Generate(request):
                    typer.echo(chunk.text, nl=False)
            except grpc.aio.AioRpcError as exc:
                typer.echo(f"\nerror: {exc.code().name}: {exc.details()}", err=True)
                raise typer.Exit(1) from None
        typer.echo()

    asyncio.run(main())


@bench_app.command("engine")
def bench_engine(
    batches: str = typer.Option("1,8,32", help="Comma-separated batch sizes"),
    tokens: int = typer.Option(64, help="Decode tokens per sequence"),
    prompt_len: int = typer.Option(32, help="Prompt tokens per sequence"),
    model: str = typer.Option("phalanx-tiny-moe"),
    repeats: int = typer.Option(3, help="Runs per measurement; the median is reported"),
    as_json: bool = typer.Option(False, "--json", help="Print JSON only"),
) -> None:
    """Engine decode tokens/s vs the model's bare forward loop, and the cost of deterministic mode."""
    from phalanx.bench.engine import run_engine_bench

    result = run_engine_bench(
        model=model, batches=[int(b) for b in batches.split(",")], decode_tokens=tokens, prompt_len=prompt_len, repeats=repeats
    )
    typer.echo(json.dumps(result, indent=None if as_json else 2))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
