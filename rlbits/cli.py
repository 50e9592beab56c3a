"""Command line.

    rlbits train [CONFIG] [key=value ...]      train (no CONFIG: configs/ppo_sentiment.yaml, the main job)
    rlbits train --resume RUN_DIR [key=value]  continue a run from its latest checkpoint
    rlbits eval RUN_DIR                         test-split reward of the final policy vs the base model
    rlbits plot RUN_DIR [RUN_DIR ...]           PNG of reward, KL, losses, entropy, throughput
    rlbits pretrain TASK                        build a task's base model
    rlbits serve-reward TASK_OR_MODEL_DIR       serve a reward over HTTP
    rlbits demo                                 the functional core on a random batch
"""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from rlbits.demo import run_demo

    run_demo(seed=args.seed)
    return 0


def _pretrain(args: argparse.Namespace) -> int:
    from rlbits.zoo import pretrain

    path = pretrain.pretrain(args.task, args.out, seed=args.seed, steps=args.steps, progress=True)
    print(path)  # last line: the folder, for scripts
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


def _train(args: argparse.Namespace) -> int:
    from rlbits.loops.api import resolve_config, train
    from rlbits.loops.config import ConfigError, read_yaml

    overrides = list(args.overrides)
    config = args.config
    if config is not None and "=" in config and not config.endswith((".yaml", ".yml")):
        overrides.insert(0, config)  # `rlbits train key=value` with no CONFIG
        config = None
    try:
        if args.resume:
            if config is not None:
                raise ConfigError("give either CONFIG or --resume RUN_DIR, not both (the run's config.yaml is used)")
            run_config = f"{args.resume}/config.yaml"
            values = read_yaml(run_config)
            values["run_dir"] = args.resume
            cfg = resolve_config(values, overrides)
        else:
            cfg = resolve_config(config, overrides)
    except ConfigError as e:
        print(f"rlbits train: {e}", file=sys.stderr)
        return 2
    run_dir = train(config=cfg, resume=bool(args.resume))
    print(run_dir)
    return 0


def _eval(args: argparse.Namespace) -> int:
    from rlbits.loops.evaluate import evaluate_run

    result = evaluate_run(args.run_dir, max_val_samples=args.max_val_samples, greedy=args.greedy)
    for name, metrics in result.items():
        print(f"{name:>6s}: " + "  ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
    return 0


def _plot(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rlbits.viz.plots import plot_run

    out = Path(args.out) if args.out else Path(args.run_dirs[0]) / "metrics.png"
    plot_run(args.run_dirs, out=out)
    print(out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlbits", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the functional core on a random batch and print each step")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)
    from rlbits.tasks import TASKS

    pre = sub.add_parser("pretrain", help="build a task's base model (tokenizer + small GPT-2), print its folder")
    pre.add_argument("task", choices=sorted(TASKS), metavar="TASK", help=f"one of {', '.join(sorted(TASKS))}")
    pre.add_argument("--out", metavar="DIR", help="output folder (default $RLBITS_CACHE/TASK-base)")
    pre.add_argument("--seed", type=int, default=0)
    pre.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the task's)")
    pre.set_defaults(func=_pretrain)
    train = sub.add_parser("train", help="train a policy (default: PPO on the sentiment task)")
    train.add_argument("config", nargs="?", metavar="CONFIG", help="YAML config (default configs/ppo_sentiment.yaml)")
    train.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    train.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its latest checkpoint")
    train.set_defaults(func=_train)
    evaluate = sub.add_parser("eval", help="test-split reward of RUN_DIR/final vs the base model")
    evaluate.add_argument("run_dir", metavar="RUN_DIR")
    evaluate.add_argument("--max-val-samples", type=int, default=None, help="test prompts (default: the run's)")
    evaluate.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling")
    evaluate.set_defaults(func=_eval)
    plot = sub.add_parser("plot", help="plot the metrics of one or more runs to a PNG")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    plot.add_argument("--out", help="PNG path (default RUN_DIR/metrics.png)")
    plot.set_defaults(func=_plot)
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
