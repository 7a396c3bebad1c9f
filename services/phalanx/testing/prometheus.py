"""A real Prometheus (Debian's `prometheus` package) scraping services a test started, and its HTTP query API."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

from phalanx.launch.ports import free_port

__all__ = ["PrometheusServer", "prometheus_installed"]


def prometheus_installed() -> bool:
    return shutil.which("prometheus") is not None


class PrometheusServer:
    """Scrapes ``targets`` (job name -> host:port list) every ``scrape_interval_s``; stopped by its PID on exit."""

    def __init__(self, targets: Mapping[str, Sequence[str]], *, scrape_interval_s: float = 1.0) -> None:
        self.targets = {job: list(addresses) for job, addresses in targets.items() if addresses}
        self.scrape_interval_s = scrape_interval_s
        self.port = 0
        self._directory: Path | None = None
        self._process: subprocess.Popen | None = None
        self._log: BinaryIO | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> PrometheusServer:
        self._directory = Path(tempfile.mkdtemp(prefix="phalanx-prometheus-"))
        interval = f"{self.scrape_interval_s:g}s"
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": addresses}]} for job, addresses in self.targets.items()
            ],
        }
        (self._directory / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.port = free_port()
        self._log = (self._directory / "prometheus.log").open("wb")
        self._process = subprocess.Popen(
            ["prometheus", f"--config.file={self._directory / 'prometheus.yml'}", f"--storage.tsdb.path={self._directory / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=self._log,
        )
        try:
            self._wait_ready(30.0)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(20)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(5)
        if self._log is not None:
            self._log.close()
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self._process is not None
            if self._process.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self._process.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"prometheus was not ready within {timeout:.0f} s")
            time.sleep(0.1)

    def query(self, expr: str) -> list[dict]:
        """The instant query's result vector (``[{"metric": {...}, "value": [t, "v"]}, ...]``); raises on a bad query."""
        query = urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api/v1/query?{query}", timeout=10) as reply:
                body = json.load(reply)
        except urllib.error.HTTPError as error:
            raise ValueError(f"prometheus refused {expr!r}: {error.read().decode(errors='replace')}") from error
        if body.get("status") != "success":
            raise ValueError(f"prometheus failed {expr!r}: {body}")
        result = body["data"]["result"]
        return result if isinstance(result, list) else [{"metric": {}, "value": result}]

    def targets_up(self) -> dict[str, bool]:
        """scrape URL -> whether its last scrape succeeded."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api/v1/targets", timeout=10) as reply:
            active = json.load(reply)["data"]["activeTargets"]
        return {t["scrapeUrl"]: t["health"] == "up" for t in active}
