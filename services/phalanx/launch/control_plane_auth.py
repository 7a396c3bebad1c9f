"""Turn etcd's authorization on with the roles of ``phalanx.common.control_plane_acl``.

etcd (``--client-cert-auth``) takes a client's user name from its certificate's CN; with auth enabled, a user that
does not exist (a tenant's ``client``) may do nothing, and every service identity only what its role allows. Applied
by ``phalanx up --tls`` to its own etcd before any service starts, by ``phalanx certs etcd-auth`` (the compose
file's one-shot ``etcd-auth``, or an operator) to any other, as ``admin`` once auth is on. Idempotent: running it
again brings the users and roles back to the table (permissions the table no longer lists are revoked).
"""

from __future__ import annotations

import asyncio
import time

import grpc
from aetcd import rpc

from phalanx.common.config import EtcdConfig
from phalanx.common.control_plane_acl import (
    ACL,
    ADMIN,
    ALLOWED_IDENTITIES,
    ETCD_MEMBER_USER,
    ETCD_ROOT_USER,
    etcd_permissions,
    etcd_role,
)
from phalanx.common.lease import connect_etcd

__all__ = ["apply_etcd_auth"]

_ROOT_ROLE = "root"  # etcd's built-in role: every key and the auth RPCs


async def _ignoring_exists(call: object) -> None:
    try:
        await call  # type: ignore[misc]  # a grpc.aio unary call
    except grpc.aio.AioRpcError as error:
        # "etcdserver: user name already exists" / "role name already exists": a second run.
        if error.code() != grpc.StatusCode.FAILED_PRECONDITION or "already exists" not in (error.details() or ""):
            raise


async def _apply(auth: rpc.AuthStub, timeout: float) -> None:
    no_password = rpc.auth_pb2.UserAddOptions(no_password=True)
    for user in (ETCD_ROOT_USER, ETCD_MEMBER_USER, *ALLOWED_IDENTITIES):
        await _ignoring_exists(auth.UserAdd(rpc.AuthUserAddRequest(name=user, options=no_password), timeout=timeout))
    for user in (ETCD_ROOT_USER, ADMIN):
        await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=user, role=_ROOT_ROLE), timeout=timeout)
    for identity in ACL:
        role = etcd_role(identity)
        await _ignoring_exists(auth.RoleAdd(rpc.AuthRoleAddRequest(name=role), timeout=timeout))
        wanted = {(p.key.encode(), p.range_end.encode()): p.write for p in etcd_permissions(identity)}
        held = (await auth.RoleGet(rpc.AuthRoleGetRequest(role=role), timeout=timeout)).perm
        for permission in held:
            if (permission.key, permission.range_end) not in wanted:
                await auth.RoleRevokePermission(
                    rpc.AuthRoleRevokePermissionRequest(role=role, key=permission.key, range_end=permission.range_end), timeout=timeout
                )
        for (key, range_end), write in wanted.items():
            kind = rpc.auth_pb2.Permission.READWRITE if write else rpc.auth_pb2.Permission.READ
            permission = rpc.auth_pb2.Permission(permType=kind, key=key, range_end=range_end)
            await auth.RoleGrantPermission(rpc.AuthRoleGrantPermissionRequest(name=role, perm=permission), timeout=timeout)
        await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=identity, role=role), timeout=timeout)
    await auth.AuthEnable(rpc.AuthEnableRequest(), timeout=timeout)


async def apply_etcd_auth(config: EtcdConfig, *, timeout_s: float = 30.0) -> None:
    """Users for root, every service identity and admin (no passwords: the client certificate authenticates), one role
    per service from the ACL table, then auth on. ``config`` must present the ``admin`` certificate once auth is on.

    etcd still starting (UNAVAILABLE) is waited for up to ``timeout_s``; any other refusal (PERMISSION_DENIED: not
    admin) is raised as is.
    """
    deadline = time.monotonic() + timeout_s
    client = connect_etcd(config)
    try:
        await client.connect()
        auth = rpc.AuthStub(client.channel)
        while True:
            try:
                await _apply(auth, config.request_timeout_s)
                return
            except grpc.aio.AioRpcError as error:
                if error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
    finally:
        await client.close()
