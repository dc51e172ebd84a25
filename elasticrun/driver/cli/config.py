"""Option values from a TOML config file and from environment variables, below the flags.

Precedence, highest first: command-line flags > ``ELASTICRUN_*`` environment variables >
``--config-file`` (TOML) > built-in defaults. Both layers are validated like the flags (same
range checks), and every problem is one line naming the key or variable, exiting with 2.

Environment variable names must never be one of the driver->worker protocol names of
``elasticrun.common.env`` (``ELASTICRUN_RANK``, ``ELASTICRUN_LOG_LEVEL``, ...): a worker
inherits the driver's environment, and the driver must not read what it sets for workers.
That is why ``--log-level`` and ``--collective-timeout`` have no variable here
(``tests/integration/test_config.py`` checks the sets are disjoint).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Mapping, NoReturn

from elasticrun.common.paths import obeyed_file_problem, read_bounded
from elasticrun.driver.cli import horovod_config
from elasticrun.driver.cli.parser import (
    module_list,
    non_negative_int,
    non_negative_number,
    port,
    positive_int,
    positive_seconds,
    seconds_or_zero,
)

#: A config file is a few lines: more than this is not one (--config-file /dev/zero).
MAX_CONFIG_BYTES = 1 << 20

# Per-cluster options settable from the environment: variable -> argparse dest.
ENV_VARS: dict[str, str] = {
    "ELASTICRUN_CONFIG_FILE": "config_file",
    "ELASTICRUN_DISCOVERY_INTERVAL": "discovery_interval",
    "ELASTICRUN_DISCOVERY_TIMEOUT": "discovery_timeout",
    "ELASTICRUN_SLOTS_PER_HOST": "slots_per_host",
    "ELASTICRUN_START_TIMEOUT": "start_timeout",
    "ELASTICRUN_ELASTIC_TIMEOUT": "elastic_timeout",
    "ELASTICRUN_HEARTBEAT_TIMEOUT": "heartbeat_timeout",
    "ELASTICRUN_LAUNCHER": "launcher",
    "ELASTICRUN_SSH_PORT": "ssh_port",
    "ELASTICRUN_SSH_USER": "ssh_user",
    "ELASTICRUN_SSH_IDENTITY_FILE": "ssh_identity_file",
    "ELASTICRUN_SSH_KNOWN_HOSTS": "ssh_known_hosts",
    "ELASTICRUN_REMOTE_PYTHON": "remote_python",
    "ELASTICRUN_NETWORK_INTERFACE": "network_interface",
    "ELASTICRUN_CHECKPOINT_DIR": "checkpoint_dir",
    "ELASTICRUN_CHECKPOINT_INTERVAL": "checkpoint_interval",
    "ELASTICRUN_WARM_START": "warm_start",  # 1/true/yes/on (the default) or 0/false/no/off
    "ELASTICRUN_RAY_ADDRESS": "ray_address",
    "ELASTICRUN_EVICT_STRAGGLERS": "evict_stragglers",
    "ELASTICRUN_PREFETCH": "prefetch",  # 1/true/yes/on (the default) or 0/false/no/off
    "ELASTICRUN_STATUS_INTERVAL": "status_interval",
}

#: Horovod's variables for the same options (horovodrun reads them when the flag is not
#: given): under the ``ELASTICRUN_*`` ones, so a job ported with its environment keeps them.
HOROVOD_ENV_VARS = {
    "HOROVOD_START_TIMEOUT": "start_timeout",
    "HOROVOD_ELASTIC_TIMEOUT": "elastic_timeout",
    "HOROVOD_GLOO_TIMEOUT_SECONDS": "collective_timeout",
    "HOROVOD_GPU_ALLREDUCE": "backend",
    "HOROVOD_GPU_OPERATIONS": "backend",
}

#: Variables naming a setting that a --no-... flag turns off: 1 means on, not "the flag given".
_SETTING_NAMED = {"ELASTICRUN_WARM_START", "ELASTICRUN_PREFETCH"}

#: How a variable sets a flag (an option without a value): given, or not given.
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}

# Flags that are not options a file can hold.
_NOT_IN_FILE = {"help", "version", "config_file", "check"}

_SUPPRESS = argparse.SUPPRESS


def _fail(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    parser.error(message)


def _convert(action: argparse.Action) -> Callable[[str], Any]:
    """The option's converter (every option of ours gives a callable ``type``, or none)."""
    if action.type is None:
        return str
    if not callable(action.type):
        raise TypeError(f"option {action.dest}: its type {action.type!r} is not a converter")
    return action.type


def _option_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest not in _NOT_IN_FILE]


def _file_keys(parser: argparse.ArgumentParser) -> dict[str, tuple[argparse.Action, bool]]:
    """Accepted TOML keys -> (action, named_by_flag). Dashes and underscores are the same."""
    keys: dict[str, tuple[argparse.Action, bool]] = {}
    for action in _option_actions(parser):
        keys[action.dest.replace("_", "-")] = (action, False)
        for flag in action.option_strings:
            name = flag.lstrip("-")
            if len(name) > 1:
                keys.setdefault(name, (action, True))
    return keys


def _type_name(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "true or false"
    if isinstance(action, argparse._AppendAction):
        return "a list of strings"
    if action.nargs == 2:
        return "a list of 2 numbers"
    if action.type in (positive_int, non_negative_int, port):
        return "a whole number"
    if action.type in (positive_seconds, seconds_or_zero):
        return "a number of seconds"
    if action.type is non_negative_number:
        return "a number"
    if action.choices:
        return "one of " + ", ".join(repr(c) for c in action.choices)
    return "a string"


def convert_value(action: argparse.Action, value: Any, named_by_flag: bool = False) -> Any:
    """A Python value (from TOML, or an ``elasticrun.run`` keyword) as the option's value, with
    the flag's own validator: ValueError(the expected type) or ArgumentTypeError(the range)."""
    expected = _type_name(action)
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise ValueError(expected)
        # `no-forward-env = true` means the flag is given; `forward-env = false` is the dest itself.
        if named_by_flag and isinstance(action, argparse._StoreFalseAction):
            return not value
        return value
    if isinstance(action, argparse._AppendAction):
        if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise ValueError(expected)
        return list(value)
    if action.nargs == 2:
        if not (isinstance(value, list) and len(value) == 2
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
            raise ValueError(expected)
        return [_convert(action)(str(v)) for v in value]
    if action.type in (positive_int, non_negative_int, port):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(expected)
        return _convert(action)(str(value))
    if action.type in (positive_seconds, non_negative_number, seconds_or_zero):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(expected)
        return _convert(action)(str(value))
    if action.type is module_list and isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        value = ",".join(value)  # preload = ["transformers", "datasets"]
    if not isinstance(value, str):
        raise ValueError(expected)
    if action.type is not None:
        value = _convert(action)(value)
    if action.choices and value not in action.choices:
        raise ValueError(expected)
    return value


def _toml_kind(value: Any) -> str:
    return {bool: "a boolean", int: "a whole number", float: "a number", str: "a string",
            list: "a list", dict: "a table"}.get(type(value), type(value).__name__)


def read_config_file(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """The options in TOML file ``path`` as argparse dests -> values (exit 2 on any problem).
    A horovodrun YAML config file is read too (``horovod_config.py``)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10: the same parser, as the tomli package (a dependency there)
        import tomli as tomllib

    why = obeyed_file_problem(path)
    if why:
        _fail(parser, f"--config-file {path}: {why}")
    try:
        raw = read_bounded(path, MAX_CONFIG_BYTES)
    except OSError as exc:
        _fail(parser, f"--config-file {path}: {exc.strerror or exc}")
    if len(raw) > MAX_CONFIG_BYTES:
        _fail(parser, f"--config-file {path}: more than 1 MiB, not a config file")
    text = raw.decode("utf-8", errors="replace")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        try:
            data = horovod_config.to_options(horovod_config.parse_yaml_sections(text))
        except ValueError as yaml_exc:
            if path.endswith((".yaml", ".yml")):
                _fail(parser, f"--config-file {path}: not a horovodrun YAML config (elasticrun reads those and "
                              f"TOML): {yaml_exc}")
            _fail(parser, f"--config-file {path}: not valid TOML: {exc}")
    keys = _file_keys(parser)
    values: dict[str, Any] = {}
    seen: dict[str, str] = {}
    for key, value in data.items():
        found = keys.get(key.replace("_", "-"))
        if found is None:
            _fail(parser, f"--config-file {path}: unknown key {key!r} (keys are elasticrun's long option "
                          f"names, e.g. min-np)")
        action, by_flag = found
        if action.dest in seen:
            _fail(parser, f"--config-file {path}: keys {seen[action.dest]!r} and {key!r} set the same option")
        seen[action.dest] = key
        try:
            values[action.dest] = convert_value(action, value, by_flag)
        except ValueError as exc:
            _fail(parser, f"--config-file {path}: key {key!r} must be {exc}, not {_toml_kind(value)} ({value!r})")
        except argparse.ArgumentTypeError as exc:
            _fail(parser, f"--config-file {path}: key {key!r}: {exc}")
    for group in _exclusive_groups(parser):
        both = [seen[a.dest] for a in group._group_actions if a.dest in seen]
        if len(both) > 1:
            _fail(parser, f"--config-file {path}: keys {both[0]!r} and {both[1]!r} cannot be used together")
    return values


def read_environment(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> dict[str, Any]:
    """Options set by ``ELASTICRUN_*`` variables (see ENV_VARS), and under them Horovod's
    (HOROVOD_ENV_VARS), as dests -> values."""
    actions = {a.dest: a for a in parser._actions}
    values: dict[str, Any] = {}
    for name, dest in [*HOROVOD_ENV_VARS.items(), *ENV_VARS.items()]:
        text = environ.get(name)
        if text is None or text == "" or dest not in actions:
            continue
        action = actions[dest]
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if text.strip().lower() not in _TRUE | _FALSE:
                _fail(parser, f"environment variable {name}={text!r}: must be 1 or 0 (true/false, yes/no, on/off)")
            given = text.strip().lower() in _TRUE
            if name in _SETTING_NAMED:
                given = not given
            values[dest] = action.const if given else action.default
            continue
        try:
            value = _convert(action)(text) if action.type is not None else text
        except argparse.ArgumentTypeError as exc:
            _fail(parser, f"environment variable {name}={text!r}: {exc}")
        if action.choices and value not in action.choices:
            _fail(parser, f"environment variable {name}={text!r}: must be one of "
                          + ", ".join(action.choices))
        values[dest] = value
    return values


def _exclusive_groups(parser: argparse.ArgumentParser) -> list[argparse._MutuallyExclusiveGroup]:
    return list(parser._mutually_exclusive_groups)


def split_command(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` as (our options, the training command).

    The command starts at the first word that is neither one of our options nor an option's
    value (or after ``--``). Everything from there on is the command's: argparse alone would
    also match the script's own flags against ours (``python train.py --n 3`` gives
    "ambiguous option: --n could match --num-proc, ..."), as abbreviations.
    """
    options: dict[str, argparse.Action] = {o: a for a in parser._actions for o in a.option_strings}
    longs = [o for o in options if o.startswith("--")]
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            return argv[:i], argv[i + 1:]
        if not word.startswith("-") or word == "-":
            return argv[:i], argv[i:]
        name, eq, _ = word.partition("=")
        action = options.get(name)
        if action is None and name.startswith("--"):
            matches = [o for o in longs if o.startswith(name)]  # an abbreviation of ours
            action = options[matches[0]] if len(matches) == 1 else None
        if action is None and not name.startswith("--") and name[:2] in options and len(name) > 2:
            i += 1  # -p2222: a short option with its value attached
            continue
        if action is None:
            i += 1  # not ours: argparse reports it
            continue
        nargs = action.nargs
        takes = 1 if nargs is None else nargs if isinstance(nargs, int) else 0
        i += 1 + (0 if eq else takes)
    return argv, []


def layered_defaults(parser: argparse.ArgumentParser, given: Mapping[str, Any],
                     environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The options the config file and the environment set, under those ``given`` (dests the
    caller sets itself: flags, or ``elasticrun.run`` keywords)."""
    environ = os.environ if environ is None else environ
    from_env = read_environment(parser, environ)
    path = given.get("config_file") or from_env.get("config_file")
    from_file = read_config_file(parser, path) if path else {}
    layered = dict(from_file)
    # Within a group of mutually exclusive options (-H / --hostfile / --host-discovery-script),
    # a higher layer replaces the whole choice of a lower one.
    for higher in (from_env, given):
        for group in _exclusive_groups(parser):
            dests = {a.dest for a in group._group_actions}
            if dests & set(higher):
                for d in dests - set(higher):
                    layered.pop(d, None)
        if higher is from_env:
            layered.update(from_env)
    return layered


def parse_args(parser: argparse.ArgumentParser, argv: list[str],
               environ: Mapping[str, str] | None = None, *,
               probe_parser: argparse.ArgumentParser) -> argparse.Namespace:
    """``parser.parse_args(argv)`` with the config file and the environment under the flags.

    ``probe_parser`` is a second, identical parser (``build_parser()`` again) used to learn
    which options the command line itself gives. With ``--check``, -np and the host options
    are not required.
    """
    environ = os.environ if environ is None else environ
    argv, command = split_command(parser, argv)
    probe = probe_parser
    for action in probe._actions:
        if action.dest != "help":
            action.default = _SUPPRESS
        action.required = False
    for group in _exclusive_groups(probe):
        group.required = False
    given = vars(probe.parse_args(argv))
    given.pop("command", None)
    layered = layered_defaults(parser, given, environ)
    parser.set_defaults(**layered)
    for action in parser._actions:
        if action.dest in layered:
            action.required = False
    for group in _exclusive_groups(parser):
        if any(a.dest in layered for a in group._group_actions):
            group.required = False
    if given.get("check"):
        for action in parser._actions:
            action.required = False
        for group in _exclusive_groups(parser):
            group.required = False
    args = parser.parse_args(argv)
    args.command = command
    return args
