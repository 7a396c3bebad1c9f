"""The router: picks a worker for each request by KV-cache overlap and load, and relays its token stream.

`index` (which worker holds which KV blocks) and `routing` (the cost model
and the choice) are pure logic; the gRPC, NATS and etcd shell calls them.
"""
