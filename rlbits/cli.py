"""Command line: ``rlbits demo`` (and, as they land, ``train``, ``pretrain``, ``eval``, ``plot``)."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from rlbits.demo import run_demo

    run_demo(seed=args.seed)
    return 0


def _serve_reward(args: argparse.Namespace) -> int:
    import os

    from rlbits.rollout.reward_server import RewardServer, load_reward

    token = None
    if args.token_env:  # the token comes from the environment: argv is visible to every user in `ps`
        token = os.environ.get(args.token_env)
        if not token:
            print(
                f"rlbits serve-reward: environment variable {args.token_env} is unset or empty",
                file=sys.stderr,
            )
            return 2
    try:
        reward = load_reward(args.target)
    except ValueError as e:
        print(f"rlbits serve-reward: {e}", file=sys.stderr)
        return 2
    server = RewardServer(
        reward, args.host, args.port, token=token, max_request_bytes=args.max_request_bytes, log_requests=True
    )
    auth = f", bearer token from ${args.token_env}" if token else ""
    print(
        f"rlbits reward server for {args.target} listening on {server.url} (POST /score, GET /health{auth})"
    )
    sys.stdout.flush()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlbits", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the functional core on a random batch and print each step")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)
    serve_reward = sub.add_parser(
        "serve-reward", help="serve a task's reward or a reward model over HTTP (docs/reward_server.md)"
    )
    serve_reward.add_argument("target", metavar="TASK_OR_MODEL_DIR", help="task name or reward-model folder")
    serve_reward.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve_reward.add_argument("--port", type=int, default=8000, help="TCP port; 0 picks a free one")
    serve_reward.add_argument(
        "--token-env", metavar="VAR", help="require the bearer token held in env var VAR"
    )
    serve_reward.add_argument(
        "--max-request-bytes", type=int, default=16 * 2**20, help="larger bodies get 413"
    )
    serve_reward.set_defaults(func=_serve_reward)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
