"""`tidectl`: operate the draft registry.

    tidectl drafts list     [TARGET]                         versions (all targets when none given)
    tidectl drafts show     VERSION | TARGET                 one version, or a target's pointer and history
    tidectl drafts pin      VERSION [--reason R]             workers run VERSION until unpin
    tidectl drafts unpin    [TARGET] [--reason R]
    tidectl drafts promote  VERSION [--reason R] [--expect-current V]
    tidectl drafts rollback [TARGET | VERSION] [--reason R] [--expect-current V]
                                                              back to the previous current (or to VERSION)
    tidectl drafts watch    TARGET                           print each assignment change (Ctrl-C stops)
    tidectl data forget     --request-id ID | --key-id ID    delete every captured row of a request / API key
    tidectl data sweep                                       apply retention and the byte budget now
    tidectl data key-id     KEY                              the id recorded for an API key (a hash)
    tidectl data new-key    ID                               a fresh "ID:base64key" line for TIDE_DATA_KEYS

Common options (before or after the subcommand): `--registry host:port` (else $TIDE_REGISTRY_ADDR,
else the registry of the `tide up` stack running from ./var or $TIDE_STACK_DIR — found through its
current-stack.json, see tools.stackfile — else 127.0.0.1:50055), `--token` (else $TIDE_ADMIN_TOKEN,
else that stack's admin-token file; needed for pin/unpin/promote/rollback),
`--json` (machine-readable output on stdout), `--timeout` seconds. `tidectl data` talks to the
trainer: `--trainer host:port` (else $TIDE_TRAINER_ADDR, else that stack's trainer, else
127.0.0.1:50054); docs/data-handling.md. A target can also be given as
`--target`; when omitted and the registry knows exactly one target, that one is used.

Exit status: 0 ok; 2 bad usage or INVALID_ARGUMENT; 3 NOT_FOUND; 4 FAILED_PRECONDITION or ABORTED;
5 UNAUTHENTICATED / PERMISSION_DENIED; 6 UNAVAILABLE / DEADLINE_EXCEEDED; 1 anything else.
Errors go to stderr as `tidectl: CODE: message` (and as {"error": {...}} on stdout with --json).
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import re
import sys

import grpc

from tide.grpcutil import ADMIN_TOKEN_ENV
from tide.registry_client import REGISTRY_ADDR_ENV, RegistryClient
from tools.admin import render
from tools.stackfile import find_stack

_VERSION_RE = re.compile(r".+/v[0-9]{4,}")
EXIT_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT: 2,
    grpc.StatusCode.NOT_FOUND: 3,
    grpc.StatusCode.FAILED_PRECONDITION: 4,
    grpc.StatusCode.ABORTED: 4,
    grpc.StatusCode.UNAUTHENTICATED: 5,
    grpc.StatusCode.PERMISSION_DENIED: 5,
    grpc.StatusCode.UNAVAILABLE: 6,
    grpc.StatusCode.DEADLINE_EXCEEDED: 6,
}


class UsageError(Exception):
    """A problem with the command line itself (exit 2)."""


def _common(p: argparse.ArgumentParser, suppress: bool) -> None:
    d = (lambda v: argparse.SUPPRESS) if suppress else (lambda v: v)
    p.add_argument("--registry", default=d(None), help=f"registry host:port (default ${REGISTRY_ADDR_ENV})")
    p.add_argument("--token", default=d(None), help=f"admin bearer token (default ${ADMIN_TOKEN_ENV})")
    p.add_argument("--json", action="store_true", default=d(False), help="print JSON instead of text")
    p.add_argument("--timeout", type=float, default=d(15.0), help="seconds per call (default 15)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tidectl", description="Operate TIDE's draft registry.")
    _common(parser, suppress=False)
    groups = parser.add_subparsers(dest="group", required=True, metavar="{drafts,data}")
    data = groups.add_parser("data", help="captured traffic: forget, sweep, key ids").add_subparsers(
        dest="command", required=True, metavar="{forget,sweep,key-id,new-key}")
    forget = data.add_parser("forget", help="delete every captured row of a request or an API key")
    _common(forget, suppress=True)
    forget.add_argument("--trainer", default=None, help="trainer host:port")
    which = forget.add_mutually_exclusive_group(required=True)
    which.add_argument("--request-id", dest="request_id", help='the response id ("chatcmpl-...", "cmpl-...")')
    which.add_argument("--key-id", dest="key_id", help="an API key's id (tidectl data key-id KEY)")
    sweep = data.add_parser("sweep", help="apply retention and the byte budget now")
    _common(sweep, suppress=True)
    sweep.add_argument("--trainer", default=None, help="trainer host:port")
    data.add_parser("key-id", help="the id recorded for an API key").add_argument("key", metavar="KEY")
    data.add_parser("new-key", help="a fresh data key line").add_argument("key_id", metavar="ID")
    drafts = groups.add_parser("drafts", help="draft versions and pointers").add_subparsers(
        dest="command", required=True, metavar="{list,show,pin,unpin,promote,rollback,watch}"
    )

    def command(name: str, help: str) -> argparse.ArgumentParser:
        p = drafts.add_parser(name, help=help)
        _common(p, suppress=True)
        p.add_argument("--target", help="target model (inferred from a version id or a single-target registry)")
        return p

    command("list", "list draft versions").add_argument("name", nargs="?", metavar="TARGET")
    command("show", "show a version, or a target's pointer").add_argument("name", metavar="VERSION|TARGET")
    for name, help in (("pin", "pin a version"), ("promote", "make a version the current one")):
        p = command(name, help)
        p.add_argument("version", metavar="VERSION")
        p.add_argument("--reason", default="")
        if name == "promote":
            _expect_current(p)
    p = command("unpin", "remove the pin of a target")
    p.add_argument("name", nargs="?", metavar="TARGET")
    p.add_argument("--reason", default="")
    p = command("rollback", "return to the previous current version")
    p.add_argument("name", nargs="?", metavar="TARGET|VERSION")
    p.add_argument("--to", dest="to_version", default="", metavar="VERSION", help="a specific previous version")
    p.add_argument("--reason", default="")
    _expect_current(p)
    command("watch", "stream a target's assignment").add_argument("name", nargs="?", metavar="TARGET")
    return parser


def _expect_current(p: argparse.ArgumentParser) -> None:
    p.add_argument("--expect-current", dest="expect_current", metavar="VERSION",
                   help="only if this is still the current version ('' = none)")


def _target(args, client: RegistryClient, name: str | None = None) -> str:
    """The target to act on: --target, a target argument, a version's target, or the only one known."""
    if args.target:
        return args.target
    if name:
        return name.rsplit("/", 1)[0] if _VERSION_RE.fullmatch(name) else name
    targets = sorted({d.target_model for d in client.list().drafts})
    if len(targets) == 1:
        return targets[0]
    raise UsageError(f"name the target (--target); the registry has {len(targets)} targets: {', '.join(targets)}")


def _emit(args, data: dict, text: str) -> None:
    print(json.dumps(data, indent=2, sort_keys=True) if args.json else text)


def _pointer_result(args, state, verb: str) -> None:
    p = render.pointer_dict(state)
    note = f"{verb}; workers of {p['target_model']} run {p['effective'] or 'no draft'}"
    if p["pinned"] and verb.startswith(("promoted", "rolled back")):
        note += f" (pinned to {p['pinned']}: unpin to run the current version)"
    _emit(args, p, note + "\n\n" + render.pointer_text(p, limit=5))


def run(args, client: RegistryClient) -> int:
    cmd = args.command
    if cmd == "list":
        target = args.target or args.name or ""
        resp = client.list(target)
        drafts = [render.draft_dict(d) for d in resp.drafts]
        names = [target] if target else sorted({d["target_model"] for d in drafts})
        pointers = {t: render.pointer_dict(client.pointer(t)) for t in names}
        data = {"drafts": drafts, "pointers": pointers, **({"pointer": pointers[target]} if target else {})}
        _emit(args, data, render.drafts_text(drafts, pointers))
    elif cmd == "show" and _VERSION_RE.fullmatch(args.name):
        d = render.draft_dict(client.get(args.name))
        pointer = render.pointer_dict(client.pointer(d["target_model"]))
        _emit(args, {**d, "state": render.states(d["version"], pointer)}, render.draft_text(d, pointer))
    elif cmd == "show":
        p = render.pointer_dict(client.pointer(_target(args, client, args.name)))
        _emit(args, p, render.pointer_text(p))
    elif cmd == "pin":
        _pointer_result(args, client.pin(args.version, args.target or "", args.reason), f"pinned {args.version}")
    elif cmd == "promote":
        state = client.promote(args.version, args.target or "", args.reason, args.expect_current)
        _pointer_result(args, state, f"promoted {args.version}")
    elif cmd == "unpin":
        _pointer_result(args, client.unpin(_target(args, client, args.name), args.reason), "unpinned")
    elif cmd == "rollback":
        to = args.to_version or (args.name if args.name and _VERSION_RE.fullmatch(args.name) else "")
        state = client.rollback(_target(args, client, args.name or to), args.reason, to, args.expect_current)
        _pointer_result(args, state, f"rolled back to {state.current}")
    elif cmd == "watch":
        target = _target(args, client, args.name)
        try:
            for a in client.watch(target):
                data = {
                    "target_model": a.target_model,
                    "version": a.version,
                    "pinned": a.pinned,
                    "generation": int(a.generation),
                }
                pinned = " (pinned)" if a.pinned else ""
                text = f"{a.target_model}: {a.version or 'no draft'}{pinned} generation {a.generation}"
                print(json.dumps(data, sort_keys=True) if args.json else text, flush=True)
        except KeyboardInterrupt:
            pass
    return 0


def _fail(args, code: str, message: str, status: int) -> int:
    if getattr(args, "json", False):
        print(json.dumps({"error": {"code": code, "message": message}}, indent=2))
    print(f"tidectl: {code}: {message}", file=sys.stderr)
    return status


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no login name (containers without a passwd entry)
        return "unknown"


def _connection(args) -> tuple[str | None, str | None]:
    """(registry address, admin token): the flags, else the environment, else the local stack's."""
    address = args.registry or os.environ.get(REGISTRY_ADDR_ENV) or None
    token = args.token or os.environ.get(ADMIN_TOKEN_ENV) or None
    if address is None:
        stack = find_stack()
        if stack is not None and stack.endpoints.get("registry"):
            address = str(stack.endpoints["registry"])
            token = token or stack.admin_token
    return address, token


def _trainer(args) -> tuple[str, str | None]:
    address = getattr(args, "trainer", None) or os.environ.get("TIDE_TRAINER_ADDR") or None
    token = args.token or os.environ.get(ADMIN_TOKEN_ENV) or None
    if address is None:
        stack = find_stack()
        if stack is not None and stack.endpoints.get("trainer"):
            address = str(stack.endpoints["trainer"])
            token = token or stack.admin_token
    return address or "127.0.0.1:50054", token


def run_data(args) -> int:
    """`tidectl data ...` (the trainer's ForgetData / SweepData, or local key helpers)."""
    from tide.datakeys import new_key_line

    if args.command == "key-id":
        from services.gateway.governance import key_id

        _emit(args, {"key_id": key_id(args.key)}, key_id(args.key))
        return 0
    if args.command == "new-key":
        print(new_key_line(args.key_id))
        return 0
    from google.protobuf.json_format import MessageToDict

    from tide.grpcutil import channel
    from tide.proto.tide.v1 import trainer_pb2, trainer_pb2_grpc

    address, token = _trainer(args)
    stub = trainer_pb2_grpc.TrainerServiceStub(channel(address, token=token))
    try:
        if args.command == "forget":
            req = trainer_pb2.ForgetDataRequest(request_id=args.request_id) if args.request_id else \
                trainer_pb2.ForgetDataRequest(key_id=args.key_id)
            r = stub.ForgetData(req, timeout=max(args.timeout, 120.0))
            data = MessageToDict(r, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
            what = args.request_id or f"key {args.key_id}"
            text = (f"forgot {what}: {r.rows_removed} rows removed; {len(r.chunks_deleted)} chunks deleted, "
                    f"{len(r.chunks_rewritten)} rewritten without them, {r.stream_entries_deleted} stream entries "
                    "deleted; the workers' speculation memories "
                    + ("told to drop them" if r.memory_notice else "NOT told (Redis unreachable: the trainer's log)")
                    + " (drafts already trained on them keep existing)")
        else:
            r = stub.SweepData(trainer_pb2.SweepDataRequest(), timeout=max(args.timeout, 120.0))
            data = MessageToDict(r, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
            text = f"deleted {dict(r.chunks_deleted) or 'nothing'}; {r.bucket_chunk_bytes} chunk bytes left " \
                   f"in {r.bucket_chunks} blobs"
        _emit(args, data, text)
        return 0
    except grpc.RpcError as e:
        code = e.code()
        return _fail(args, code.name, f"trainer at {address}: {e.details() or code.name}", EXIT_CODES.get(code, 1))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.group == "data":
        return run_data(args)
    address, token = _connection(args)
    client = RegistryClient(address, token=token, actor=f"tidectl:{_user()}", timeout_s=args.timeout)
    try:
        return run(args, client)
    except UsageError as e:
        return _fail(args, "USAGE", str(e), 2)
    except grpc.RpcError as e:
        code = e.code()
        message = e.details() or code.name
        if code is grpc.StatusCode.UNAVAILABLE:
            message = f"registry at {client.address} unavailable: {message}"
        elif code is grpc.StatusCode.UNAUTHENTICATED and not token:
            message += f" (pass --token or set {ADMIN_TOKEN_ENV})"
        return _fail(args, code.name, message, EXIT_CODES.get(code, 1))
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
