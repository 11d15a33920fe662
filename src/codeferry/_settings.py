"""Every setting codeferry reads from the environment, and the shared defaults: one table.

Each value is read when it is asked for, never at import (vLLM's ``envs.py`` idea without its
import-time reads): a test, a worker or a user may change the environment after ``import
codeferry``, and the next call sees it. No other module of the package reads
``os.environ`` (``tests/house/test_layers.py`` pins that), so this table is complete, and the
settings page of the docs is generated from it (``markdown()``).

Where a variable belongs to another library (``HF_HOME``, ``HF_HUB_CACHE``...), codeferry
reads it with that library's rules, so both agree on where files are.
"""

from __future__ import annotations

import os

# At run time this module imports ``os`` only: the boot of ``codeferry exec`` reads the switch
# here in every Python process of the command, and most of them never need more.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping
    from pathlib import Path

__all__ = [
    "SETTINGS",
    "DEBUG_VARIABLES",
    "DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_RAY_SHIP_LIMIT",
    "Setting",
    "codeferry_home",
    "releases_home",
    "cuda_visible_devices",
    "debug",
    "hub_cache",
    "environment_with",
    "hub_endpoint",
    "install_switch",
    "lock_switched_off",
    "set_lock_file",
    "vllm_cache_size_set",
    "vllm_in_process",
    "lock_file",
    "markdown",
    "modules_cache",
    "names",
    "offline_reason",
    "quiet_hub_progress",
    "restore_hub_progress",
    "ray_address",
    "python_path",
    "ray_ship_limit",
    "sandbox_landlock",
    "sandbox_list",
    "sandbox_switch",
    "scrub_environment",
    "set_temp_dir",
    "vllm_plugin_enabled",
]

#: New tokens a generate request gets when neither the caller nor the input line says.
DEFAULT_MAX_NEW_TOKENS = 16
#: Bytes of large files (weights) the Ray driver ships itself before nodes must have them.
DEFAULT_RAY_SHIP_LIMIT = 2 * 1024**3
DEFAULT_ENDPOINT = "https://huggingface.co"
#: Environment variables that turn ``--debug`` on (``HF_DEBUG``: huggingface_hub's own).
DEBUG_VARIABLES = ("CODEFERRY_DEBUG", "HF_DEBUG")

#: huggingface_hub's reading of a boolean environment variable.
_TRUE = frozenset({"1", "ON", "YES", "TRUE"})
_FALSE = frozenset({"0", "OFF", "NO", "FALSE"})


class Setting:
    """One environment variable (or a few that mean one thing): its default, what it does."""

    __slots__ = ("default", "meaning", "names")

    def __init__(self, names: tuple[str, ...], default: str, meaning: str) -> None:
        self.names = names  # one variable, or a few read together (the same meaning)
        self.default = default
        self.meaning = meaning


SETTINGS: tuple[Setting, ...] = (
    Setting(
        ("CODEFERRY_HOME",),
        "`$XDG_CACHE_HOME/codeferry`, else `~/.cache/codeferry`",
        "codeferry's store of verified code units (`v1/units/<token>/`), written atomically under a file lock per unit; "
        "also who holds `codeferry run`'s outputs (`run-locks/`: notes; the lock is the output file's own)",
    ),
    Setting(
        ("CODEFERRY_RELEASES",),
        "`$CODEFERRY_HOME/releases`",
        "release environments: `transformers-<line>-<python>/`, a release some model's code needs, made once (`codeferry release` or the first run; see Loading)",
    ),
    Setting(
        ("XDG_CACHE_HOME",),
        "`~/.cache`",
        "the folder above the default store and the default hub cache",
    ),
    Setting(
        ("HF_HUB_CACHE",),
        "`$HF_HOME/hub`",
        "the Hugging Face hub cache repo ids are found in (huggingface_hub's rule); `cache_dir=` / `--cache-dir` override it",
    ),
    Setting(
        ("HF_HOME",),
        "`~/.cache/huggingface` (`$XDG_CACHE_HOME/huggingface` for the hub cache)",
        "the Hugging Face home: `hub/` (the hub cache) and `modules/` (transformers' module cache) below it",
    ),
    Setting(
        ("HF_MODULES_CACHE",),
        "`$HF_HOME/modules`",
        "where transformers keeps the remote code it loads itself; packages codeferry registers under `transformers_modules.` names resolve there beside it",
    ),
    Setting(
        ("CODEFERRY_VLLM_PLUGIN",),
        "on",
        '`0` keeps codeferry\'s plugin out of vLLM (see "Inside vLLM"); with `CODEFERRY_LOCK` set, vLLM then refuses to start (`PluginDisabledUnderLockError`)',
    ),
    Setting(
        ("CODEFERRY_CPU_PACK",),
        "on",
        "`0` leaves a CPU worker's Linear layers as they are; on, their weights are packed once for oneDNN when the model is built (faster decoding, the weights' memory once more; see the executor page)",
    ),
    Setting(
        ("CODEFERRY_CPU_BIND",),
        "on",
        "`0` lets a local CPU worker of the transformers engine run on any core; on, each is bound to cores of its own when there are enough (see the executor page)",
    ),
    Setting(
        ("CODEFERRY_CPU_FLOAT32_ATTENTION",),
        "on",
        "`0` keeps a model's own attention in a CPU worker's decode loop; on, codeferry's attention runs there: a step attends over each layer's whole buffers, and a bfloat16 or float16 model's keys and values are stored and attended in float32 (faster on CPU, that cache twice the bytes; see the executor page)",
    ),
    Setting(
        ("CODEFERRY_CPU_DECODE_KEYS",),
        "timed",
        "how that decode loop's steps attend: `innermost` (two products, keys stored columns innermost), `last` (two products, keys as they come) or `sdpa` (torch's SDPA, keys as they come); otherwise each worker times the three at its model's shapes and takes the fastest",
    ),
    Setting(
        ("VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_NUM_THREADS", "VLLM_CPU_KVCACHE_SPACE"),
        "vLLM's (on); unset; unset",
        "vLLM's and OpenMP's own variables, which codeferry writes and never reads: an executor worker with `engine=\"vllm\"` sets the first to `0` before it builds its engine, so that vLLM's EngineCore runs inside the worker (a daemonic process, which may start none of its own; `exec --sandbox` too, where unset), and the second, where unset, to the worker's threads (vLLM would cut torch to one; see the executor page); without the third, a CPU machine's workers divide half its free memory",
    ),
    Setting(
        ("CODEFERRY_LOCK",),
        "unset",
        "a lock file every process enforces: every vLLM process, and under `codeferry exec --lock` (or `CODEFERRY_INSTALL=1`) every Python process of the command",
    ),
    Setting(
        ("CODEFERRY_INSTALL",),
        "unset (off)",
        "`1` (or `true`, `yes`, `on`) with codeferry's boot folder first on `PYTHONPATH` (what `codeferry exec` sets; `codeferry exec --print-env` prints both): every Python process routes transformers' remote-code loading through codeferry, as after `install()`, from its import of transformers on (see \"No change to your code\"); set to anything else while `CODEFERRY_LOCK` is set, every process that would load remote code refuses (`PluginDisabledUnderLockError`)",
    ),
    Setting(
        ("PYTHONPATH",),
        "unset",
        "`codeferry exec` puts codeferry's boot folder first on it for COMMAND (the rest kept, in order)",
    ),
    Setting(
        ("TMPDIR",),
        "the system's temporary folder",
        "where each process keeps its private, read-only copy of the checked code and assets (`codeferry-private-<pid>-*/`, removed at exit); refused (`StorePermissionError`) when another user owns it or can write it or a folder above it without the sticky bit",
    ),
    Setting(
        ("CUDA_VISIBLE_DEVICES",),
        "all devices",
        "read to explain a `--device cuda:N` this machine does not show (`DeviceError`)",
    ),
    Setting(
        ("CODEFERRY_DEBUG", "HF_DEBUG"),
        "unset",
        "`1` (or `true`, `yes`, `on`): every command prints whole tracebacks, as with `--debug`",
    ),
    Setting(
        ("HF_HUB_DISABLE_PROGRESS_BARS",),
        "set to `1` by `codeferry run` unless already set",
        "keeps the workers' \"Loading weights\" bars off the terminal that shows the run's own bar",
    ),
    Setting(
        ("COLUMNS", "LINES"),
        "`80`, `20`",
        "the size of `codeferry run`'s progress bar on a terminal that reports none",
    ),
    Setting(
        ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"),
        "unset",
        "`1` (or `true`, `yes`, `on`): never download; a repo id the cache lacks raises `ModelNotCachedError`, and no request is sent",
    ),
    Setting(
        ("HF_ENDPOINT",),
        "`https://huggingface.co`",
        "the Hub that repo ids are downloaded from (a mirror, or a private Hub)",
    ),
    Setting(
        ("RAY_ADDRESS",),
        "unset (a local cluster)",
        'the Ray cluster `backend="ray"` / `--backend ray` joins when no `address=` / `--address` is given, as for `ray.init`',
    ),
    Setting(
        ("CODEFERRY_RAY_SHIP_LIMIT",),
        "`2147483648` (2 GiB)",
        'with `backend="ray"`: the most bytes of weights the driver ships through Ray\'s object store; a node that lacks them in its own hub cache when they are larger fails with `WeightsTooLargeError` (see "Past one machine")',
    ),
    Setting(
        ("CODEFERRY_SANDBOX",),
        "off",
        "`1`: model code runs in the box, as `--sandbox` (`run`, `exec`) asks (security page)",
    ),
    Setting(
        ("CODEFERRY_SANDBOX_LANDLOCK",),
        "on",
        "`0` acts as a kernel without Landlock: the box then fails, typed",
    ),
    Setting(
        ("CODEFERRY_SANDBOX_READ", "CODEFERRY_SANDBOX_WRITE"),
        "none",
        "more folders the box lets code read, or write (`os.pathsep`-separated)",
    ),
    Setting(
        ("CODEFERRY_SANDBOX_PORTS",),
        "none",
        "TCP ports (comma-separated) the box lets code bind and connect to",
    ),
    Setting(
        ("CODEFERRY_SANDBOX_KEEP",),
        "none",
        "credential variables (comma-separated) the box keeps",
    ),
    Setting(
        ("HF_TOKEN",),
        "unset, then the token `hf auth login` saved",
        "the token sent for gated and private repos, read by huggingface_hub; `token=` / `--token` override it",
    ),
    Setting(
        ("HUGGINGFACE_HUB_CACHE",),
        "unset",
        "the older name of `HF_HUB_CACHE` (huggingface_hub honours it; so does codeferry)",
    ),
)


def _get(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value is not None and value.strip() else None


def _path(value: str, *, expand: bool = True) -> Path:
    from pathlib import Path  # when asked for, not at import (see the imports above)

    return Path(value).expanduser() if expand else Path(value)


def _xdg_cache() -> Path:
    return _path(_get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                 expand=False)


def codeferry_home() -> Path:
    """The store's home: ``CODEFERRY_HOME`` or ``$XDG_CACHE_HOME/codeferry``."""
    home = _get("CODEFERRY_HOME")
    return _path(home) if home else _xdg_cache() / "codeferry"


def releases_home() -> Path:
    """Where release environments are: ``CODEFERRY_RELEASES`` or ``$CODEFERRY_HOME/releases``."""
    home = _get("CODEFERRY_RELEASES")
    return _path(home) if home else codeferry_home() / "releases"


def _hf_home() -> Path:
    home = _get("HF_HOME")
    return _path(home) if home else _xdg_cache() / "huggingface"


def hub_cache() -> Path:
    """The hub cache with huggingface_hub's rules, as the environment says now."""
    cache = _get("HF_HUB_CACHE") or _get("HUGGINGFACE_HUB_CACHE")
    return _path(cache) if cache else _hf_home() / "hub"


def modules_cache() -> Path:
    """transformers' module cache (``HF_MODULES_CACHE``, else ``$HF_HOME/modules``)."""
    cache = _get("HF_MODULES_CACHE")
    return _path(cache) if cache else _hf_home() / "modules"


def offline_reason(local_files_only: bool | None = None) -> str | None:
    """What forbids downloading now (``"HF_HUB_OFFLINE=1"``...), or ``None``: nothing does."""
    if local_files_only:
        return "local_files_only=True"
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        value = os.environ.get(name)
        if value is not None and value.strip().upper() in _TRUE:
            return f"{name}={value}"
    return None


def hub_endpoint() -> str:
    return (_get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def debug() -> bool:
    """Whether ``CODEFERRY_DEBUG`` or ``HF_DEBUG`` is set to a true value."""
    return any((os.environ.get(name) or "").strip().upper() in _TRUE for name in DEBUG_VARIABLES)


def vllm_plugin_enabled() -> bool:
    """Whether ``CODEFERRY_VLLM_PLUGIN`` leaves the vLLM plugin on (the default)."""
    return (os.environ.get("CODEFERRY_VLLM_PLUGIN") or "1").strip().upper() not in _FALSE


def cpu_pack_enabled() -> bool:
    """Whether ``CODEFERRY_CPU_PACK`` leaves CPU workers' weight packing on (the default)."""
    return (os.environ.get("CODEFERRY_CPU_PACK") or "1").strip().upper() not in _FALSE


def cpu_bind() -> bool:
    """Whether ``CODEFERRY_CPU_BIND`` leaves local CPU workers bound to cores of their own
    (the default)."""
    return (os.environ.get("CODEFERRY_CPU_BIND") or "1").strip().upper() not in _FALSE


def cpu_float32_attention() -> bool:
    """Whether ``CODEFERRY_CPU_FLOAT32_ATTENTION`` leaves the decode loop's float32 attention
    on for half-precision models on CPU (the default)."""
    return (os.environ.get("CODEFERRY_CPU_FLOAT32_ATTENTION") or "1").strip().upper() not in _FALSE


def cpu_decode_keys() -> str | None:
    """``CODEFERRY_CPU_DECODE_KEYS``: ``"innermost"``, ``"last"`` or ``"sdpa"`` where it says
    so, else ``None`` (the worker times the three)."""
    value = (os.environ.get("CODEFERRY_CPU_DECODE_KEYS") or "").strip().lower()
    return value if value in ("innermost", "last", "sdpa") else None


def lock_file() -> str | None:
    """``CODEFERRY_LOCK``: the lock every vLLM process enforces, if one is set."""
    value = os.environ.get("CODEFERRY_LOCK", "").strip()
    return value or None


def set_lock_file(path: str | None) -> None:
    """Name (or, with ``None``, unname) the lock in ``CODEFERRY_LOCK`` for the processes this
    one starts from now on: a worker's vLLM engine binds vLLM's own processes with it."""
    if path is None:
        os.environ.pop("CODEFERRY_LOCK", None)
    else:
        os.environ["CODEFERRY_LOCK"] = path


def vllm_in_process(threads: int) -> None:
    """Ask vLLM (read when it builds an engine) to run its EngineCore in this process: an
    executor worker is a daemonic process, which may start no processes of its own. And to
    keep the worker's ``threads``: vLLM cuts torch to one thread for serving unless
    ``OMP_NUM_THREADS`` is set, and a value the user set stays theirs."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))


def vllm_cache_size_set() -> bool:
    """Whether ``VLLM_CPU_KVCACHE_SPACE`` (vLLM's own) sizes a CPU engine's cache: without it
    the workers of a machine divide half its free memory (``vllm_engine``)."""
    return bool(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip())


def install_switch() -> bool:
    """``CODEFERRY_INSTALL``: whether a process started with codeferry's boot folder on its
    path routes remote code through codeferry (``codeferry exec`` sets it)."""
    return (os.environ.get("CODEFERRY_INSTALL") or "").strip().upper() in _TRUE


def lock_switched_off(*, vllm: bool = False) -> str | None:
    """The one rule for a lock with codeferry switched off: a lock nothing enforces binds
    nothing, so when ``CODEFERRY_LOCK`` names one and a switch turns codeferry off in this
    process, the switch as ``NAME=value``, and the process refuses, typed
    (``PluginDisabledUnderLockError``), before any remote code can load: the boot of
    ``codeferry exec`` when transformers' ``dynamic_module_utils`` is imported, the vLLM
    plugin (``vllm``) in ``register()``. ``None``: no lock, or nothing switched off.

    ``CODEFERRY_INSTALL`` set to anything but a true value switches codeferry off in every
    process (unset, it is simply not asked for); ``CODEFERRY_VLLM_PLUGIN`` off, in vLLM's."""
    if lock_file() is None:
        return None
    install = os.environ.get("CODEFERRY_INSTALL", "")
    if install.strip() and not install_switch():
        return f"CODEFERRY_INSTALL={install}"
    if vllm and not vllm_plugin_enabled():
        return f"CODEFERRY_VLLM_PLUGIN={os.environ.get('CODEFERRY_VLLM_PLUGIN')}"
    return None


def python_path() -> list[str]:
    """``PYTHONPATH``'s entries, in order (empty ones kept: Python reads them as the current
    folder)."""
    value = os.environ.get("PYTHONPATH") or ""
    return value.split(os.pathsep) if value else []


def environment_with(updates: Mapping[str, str]) -> dict[str, str]:
    """This process's environment with ``updates``: what a command started now gets."""
    return {**os.environ, **updates}


def ray_ship_limit() -> int:
    value = _get("CODEFERRY_RAY_SHIP_LIMIT")
    return int(value) if value else DEFAULT_RAY_SHIP_LIMIT


def ray_address() -> str | None:
    return _get("RAY_ADDRESS")


def cuda_visible_devices() -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def quiet_hub_progress() -> bool:
    """Turn huggingface_hub's progress bars off unless the user set them (the command line
    draws its own); whether this set them (``restore_hub_progress`` unsets them)."""
    if "HF_HUB_DISABLE_PROGRESS_BARS" in os.environ:
        return False
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    return True


def restore_hub_progress() -> None:
    """Undo ``quiet_hub_progress`` (for a caller it returned ``True`` to)."""
    os.environ.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)


def sandbox_switch() -> bool:
    """``CODEFERRY_SANDBOX``: whether model code runs in the box when nobody said."""
    return (os.environ.get("CODEFERRY_SANDBOX") or "").strip().upper() in _TRUE


def sandbox_landlock() -> bool:
    """``CODEFERRY_SANDBOX_LANDLOCK``: ``False`` acts as a kernel without Landlock."""
    return (os.environ.get("CODEFERRY_SANDBOX_LANDLOCK") or "1").strip().upper() not in _FALSE


def sandbox_list(name: str) -> tuple[str, ...]:
    """A list setting of the box: ``READ``/``WRITE`` (paths, ``os.pathsep``), ``PORTS`` or
    ``KEEP`` (commas), as the suffix of ``CODEFERRY_SANDBOX_``."""
    value = _get(f"CODEFERRY_SANDBOX_{name}") or ""
    parts = value.split(os.pathsep if name in ("READ", "WRITE") else ",")
    return tuple(p.strip() for p in parts if p.strip())


def scrub_environment(drop: frozenset[str] | set[str]) -> None:
    """Remove the variables ``drop`` from this process's environment (the box's credentials:
    this process only, its parent keeps them)."""
    for name in drop:
        os.environ.pop(name, None)


def set_temp_dir(path: str) -> None:
    """``TMPDIR`` for this process and those it starts (the box's scratch folder)."""
    os.environ["TMPDIR"] = path


def names() -> frozenset[str]:
    """Every variable of the table."""
    return frozenset(n for s in SETTINGS for n in s.names)


def markdown() -> str:
    """The settings table of the docs (``docs/settings.md`` is regenerated from it)."""
    rows = ["| variable | default | what |", "|---|---|---|"]
    rows += [
        "| " + ", ".join(f"`{n}`" for n in s.names) + f" | {s.default} | {s.meaning} |"
        for s in SETTINGS
    ]
    return "\n".join(rows) + "\n"

