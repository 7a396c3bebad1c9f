"""A real HTTP server that answers the Kubernetes API calls the planner's kubernetes connector makes (StatefulSet scale
PATCH and StatefulSet GET), for tests: the official client's own requests and deserialisation run unchanged against it."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kubernetes import client

__all__ = ["SecretsApiServer", "StatefulSetApiServer"]


class StatefulSetApiServer:
    """A real HTTP server speaking the two calls the connector makes, StatefulSet scale PATCH and StatefulSet GET, with the
    ready replicas a test sets: the official client's own requests and deserialisation run unchanged against it."""

    def __init__(self) -> None:
        self.patches: list[tuple[str, str, dict]] = []  # (StatefulSet, Content-Type, body)
        self.reads: list[str] = []
        self.ready: dict[str, int] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path) of every call, in order
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _reply(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PATCH(self) -> None:
                server.requests.append(("PATCH", self.path))
                name = self.path.split("/statefulsets/", 1)[1].removesuffix("/scale")
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.patches.append((name, self.headers["Content-Type"], body))
                replicas = body["spec"]["replicas"]
                self._reply({"apiVersion": "autoscaling/v1", "kind": "Scale", "metadata": {"name": name},
                             "spec": {"replicas": replicas}, "status": {"replicas": server.ready.get(name, 0)}})

            def do_GET(self) -> None:
                server.requests.append(("GET", self.path))
                name = self.path.split("/statefulsets/", 1)[1]
                server.reads.append(name)
                ready = server.ready.get(name, 0)
                self._reply({"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": name},
                             "spec": {"replicas": ready, "serviceName": name, "selector": {}, "template": {}},
                             "status": {"replicas": ready, "readyReplicas": ready}})

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def apps_api(self) -> client.AppsV1Api:
        configuration = client.Configuration()
        configuration.host = f"http://127.0.0.1:{self.http.server_address[1]}"
        return client.AppsV1Api(client.ApiClient(configuration))

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.thread.join(5)


class SecretsApiServer:
    """A real HTTP server keeping Secrets in one namespace, for the chart's certificate job (phalanx.launch.kube_certs):
    GET and POST of ``/api/v1/namespaces/<ns>/secrets[/<name>]`` as the API server answers them (404 for a missing
    Secret, 409 for one that exists), every call recorded as (method, path)."""

    def __init__(self, namespace: str = "default") -> None:
        self.namespace = namespace
        self.secrets: dict[str, dict] = {}
        self.requests: list[tuple[str, str]] = []
        server = self
        prefix = f"/api/v1/namespaces/{namespace}/secrets"

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _status(self, code: int, reason: str) -> None:
                self._reply(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "code": code})

            def do_GET(self) -> None:
                server.requests.append(("GET", self.path))
                name = self.path.removeprefix(prefix + "/")
                if not self.path.startswith(prefix + "/") or name not in server.secrets:
                    self._status(404, "NotFound")
                else:
                    self._reply(200, server.secrets[name])

            def do_POST(self) -> None:
                server.requests.append(("POST", self.path))
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                name = body["metadata"]["name"]
                if self.path != prefix:
                    self._status(404, "NotFound")
                elif name in server.secrets:
                    self._status(409, "AlreadyExists")
                else:
                    server.secrets[name] = {**body, "apiVersion": "v1", "kind": "Secret"}
                    self._reply(201, server.secrets[name])

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def core_api(self) -> client.CoreV1Api:
        configuration = client.Configuration()
        configuration.host = f"http://127.0.0.1:{self.http.server_address[1]}"
        return client.CoreV1Api(client.ApiClient(configuration))

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.thread.join(5)
