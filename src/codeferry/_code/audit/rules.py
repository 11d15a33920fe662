"""The audit's rules: which qualified names do what, and the tables the checks consult.

A rule maps a fully qualified name to (category, reason). ``name.*`` rules match any name
below ``name`` and only when called (``subprocess.PIPE`` is harmless); exact rules also
match a plain reference (``f = os.system`` hands the function on). The rest are tables for
checks that look at arguments (``open`` modes, write targets, YAML loaders) or at method
names whatever the receiver (Hub downloads).
"""

from __future__ import annotations

import builtins
import re
import sys

__all__ = ["match_rules"]

_EXEC = ("execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp", "execvpe")
_SPAWN = ("spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe")
_MP = ("Process", "Pool", "get_context", "set_start_method", "Manager", "spawn", "start_processes")

_RULES: dict[str, list[tuple[str, str]]] = {}


def _rule(category: str, reason: str, *names: str) -> None:
    for name in names:
        _RULES.setdefault(name, []).append((category, reason))


_rule("process", "runs a program", "subprocess.*", "subprocess.run", "subprocess.call",
      "subprocess.check_call", "subprocess.check_output", "subprocess.Popen",
      "subprocess.getoutput", "subprocess.getstatusoutput", "asyncio.create_subprocess_exec",
      "os.posix_spawn", "os.posix_spawnp", "os.startfile", *(f"os.{n}" for n in _SPAWN))
_rule("process", "runs a shell command", "os.system", "os.popen",
      "asyncio.create_subprocess_shell")
_rule("process", "replaces this process with another program", *(f"os.{n}" for n in _EXEC))
_rule("process", "forks this process", "os.fork", "os.forkpty")
_rule("process", "sends a signal to another process", "os.kill", "os.killpg")
_rule("process", "runs a program on a pseudo-terminal", "pty.*", "pty.spawn", "pty.fork")
_rule("process", "starts worker processes", "concurrent.futures.ProcessPoolExecutor",
      "concurrent.futures.process.ProcessPoolExecutor", "multiprocessing.pool.Pool",
      *(f"multiprocessing.{n}" for n in _MP), *(f"torch.multiprocessing.{n}" for n in _MP))
_rule("process", "opens a web browser", "webbrowser.*")

_rule("network", "opens a network socket", "socket.*", "socket.socket",
      "socket.create_connection")
_rule("network", "makes HTTP requests", "requests.*", "urllib3.*", "httpx.*", "aiohttp.*",
      "http.client.*", "xmlrpc.client.*")
_rule("network", "opens a URL", "urllib.request.*", "urllib.request.urlopen",
      "urllib.request.urlretrieve")
_rule("network", "opens a network connection", "ftplib.*", "smtplib.*", "poplib.*",
      "imaplib.*", "telnetlib.*", "websocket.*", "websockets.*", "paramiko.*", "boto3.*")
_rule("network", "downloads a file", "wget.*", "torch.hub.*",
      "torch.hub.download_url_to_file", "torch.hub.load_state_dict_from_url")
_rule("network", "downloads a dataset", "datasets.load_dataset")

_rule("dynamic-code", "evaluates a string as code", "builtins.eval")
_rule("dynamic-code", "executes a string as code", "builtins.exec")
_rule("dynamic-code", "compiles a string to code", "builtins.compile")
_rule("dynamic-code", "imports a module chosen at run time", "builtins.__import__",
      "importlib.import_module", "importlib.__import__", "pydoc.locate")
_rule("dynamic-code", "re-executes a module", "importlib.reload", "imp.reload")
_rule("dynamic-code", "loads a module from a file path", "importlib.util.spec_from_file_location",
      "importlib.util.spec_from_loader", "importlib.util.module_from_spec",
      "importlib.machinery.SourceFileLoader", "importlib.machinery.SourcelessFileLoader",
      "imp.load_source", "imp.load_compiled", "imp.load_module", "zipimport.zipimporter")
_rule("dynamic-code", "runs a module or script", "runpy.*", "runpy.run_path", "runpy.run_module")
_rule("dynamic-code", "starts an interactive interpreter", "code.interact",
      "code.InteractiveConsole", "code.InteractiveInterpreter")
_rule("dynamic-code", "runs a hubconf.py downloaded from the internet", "torch.hub.load")

_rule("native-code", "calls into native code (ctypes)", "ctypes.*", "ctypes.CDLL", "ctypes.cdll",
      "ctypes.PyDLL", "ctypes.pydll", "ctypes.WinDLL", "ctypes.windll", "ctypes.OleDLL")
_rule("native-code", "compiles or loads native code (cffi)", "cffi.*", "cffi.FFI")
_rule("native-code", "compiles and loads a C++/CUDA extension", "torch.utils.cpp_extension.*",
      "torch.utils.cpp_extension.load", "torch.utils.cpp_extension.load_inline")
_rule("native-code", "loads a shared library of custom ops", "torch.ops.load_library",
      "torch.classes.load_library")
_rule("native-code", "loads a compiled extension module", "imp.load_dynamic",
      "importlib.machinery.ExtensionFileLoader")
_rule("native-code", "compiles a CUDA kernel", "cupy.RawKernel", "cupy.RawModule",
      "cupy.ElementwiseKernel", "cupy.ReductionKernel", "pycuda.compiler.*")

_rule("unpickle", "unpickles data, which can run any code", "pickle.load", "pickle.loads",
      "pickle.Unpickler", "_pickle.load", "_pickle.loads", "_pickle.Unpickler", "cPickle.*",
      "dill.load", "dill.loads", "cloudpickle.load", "cloudpickle.loads", "joblib.load",
      "pandas.read_pickle", "shelve.open", "jsonpickle.decode", "torch.serialization.load")
_rule("unpickle", "unmarshals code objects", "marshal.load", "marshal.loads")
_rule("unpickle", "loads a TorchScript archive (pickled code)", "torch.jit.load")
_rule("unpickle", "loads YAML with a loader that builds any Python object", "yaml.unsafe_load",
      "yaml.unsafe_load_all")

_rule("environment", "changes the environment of the whole process", "os.putenv", "os.unsetenv",
      *(f"os.{env}.{m}" for env in ("environ", "environb")
        for m in ("update", "pop", "popitem", "setdefault", "clear", "__setitem__", "__delitem__")))
_rule("environment", "changes where every import looks", "site.addsitedir",
      *(f"sys.{v}.{m}" for v in ("path", "meta_path", "path_hooks")
        for m in ("insert", "append", "extend", "remove", "pop", "clear", "__setitem__",
                  "__delitem__", "reverse", "sort")))
_rule("environment", "changes sys.modules, the module table of the whole process",
      *(f"sys.modules.{m}" for m in ("update", "pop", "popitem", "setdefault", "clear",
                                     "__setitem__", "__delitem__")))
_rule("environment", "changes the working directory of the whole process", "os.chdir", "os.fchdir")
_rule("environment", "changes the file creation mask of the whole process", "os.umask")
_rule("environment", "installs a signal handler", "signal.signal", "signal.set_wakeup_fd",
      "signal.setitimer", "signal.alarm")
_rule("environment", "changes interpreter-wide settings", "sys.settrace", "sys.setprofile",
      "threading.settrace", "threading.setprofile", "sys.setrecursionlimit",
      "sys.setswitchinterval", "sys.setdlopenflags")

#: Calls by their last name, whatever the receiver (their owners are unknowable statically).
_HUB_DOWNLOADS = frozenset({
    "hf_hub_download", "snapshot_download", "HfApi", "HfFileSystem", "InferenceClient",
    "AsyncInferenceClient", "cached_download", "upload_file", "upload_folder", "create_repo",
    "delete_repo", "create_commit", "login", "whoami", "model_info", "list_models",
    "list_repo_files", "list_repo_tree", "file_exists", "repo_exists", "get_hf_file_metadata",
    "Repository",
})  # fmt: skip
_TRANSFORMERS_DOWNLOADS = frozenset({
    "cached_file", "cached_files", "get_file_from_repo", "hf_hub_download", "snapshot_download",
    "download_url", "cached_path", "has_file", "get_checkpoint_shard_files", "http_get",
})  # fmt: skip
_TRANSFORMERS_DYNAMIC = frozenset({"get_class_from_dynamic_module", "get_cached_module_file"})

SAFE_YAML_LOADERS = frozenset({"yaml.SafeLoader", "yaml.CSafeLoader", "yaml.BaseLoader",
                                "yaml.CBaseLoader", "yaml.loader.SafeLoader"})  # fmt: skip
COMPILERS = frozenset({"nvcc", "gcc", "g++", "cc", "c++", "clang", "clang++", "ld", "make",
                        "cmake", "ninja", "hipcc", "icc", "icpx", "nvrtc", "cl"})  # fmt: skip
SHARED_LIBRARY = re.compile(r"\.(so(\.\d+)*|dll|dylib|pyd)$", re.IGNORECASE)
OPENERS = {  # qualified name -> index of the mode argument
    "builtins.open": 1, "io.open": 1, "codecs.open": 1, "gzip.open": 1, "bz2.open": 1,
    "lzma.open": 1, "tarfile.open": 1, "os.fdopen": 1, "zipfile.ZipFile": 1, "io.FileIO": 1,
}  # fmt: skip
WRITE_FLAGS = ("O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC")
# qualified name -> indexes (and keyword names) of the paths it writes.
WRITERS: dict[str, tuple[tuple[int, str], ...]] = {
    **{f"shutil.{n}": ((1, "dst"),) for n in ("copy", "copy2", "copyfile", "copytree")},
    "shutil.move": ((0, "src"), (1, "dst")),
    "shutil.rmtree": ((0, "path"),),
    "shutil.make_archive": ((0, "base_name"),),
    "shutil.unpack_archive": ((1, "extract_dir"),),
    "shutil.chown": ((0, "path"),),
    **{f"os.{n}": ((0, "path"),) for n in ("remove", "unlink", "rmdir", "removedirs", "mkdir",
                                           "makedirs", "truncate", "chmod", "chown", "lchown",
                                           "mkfifo", "mknod", "utime")},
    **{f"os.{n}": ((0, "src"), (1, "dst")) for n in ("rename", "renames", "replace")},
    "os.link": ((1, "dst"),),
    "os.symlink": ((1, "dst"),),
    "torch.save": ((1, "f"),),
    **{f"numpy.{n}": ((0, "file"),) for n in ("save", "savez", "savez_compressed")},
    "numpy.savetxt": ((0, "fname"),),
    "safetensors.torch.save_file": ((1, "filename"),),
    "safetensors.numpy.save_file": ((1, "filename"),),
}
# qualified name -> (index, keyword, default) of the path it reads; default: read when left out.
READERS: dict[str, tuple[int, str, str | None]] = {
    "os.listdir": (0, "path", None), "os.scandir": (0, "path", None), "os.walk": (0, "top", None),
    "numpy.load": (0, "file", None), "numpy.loadtxt": (0, "fname", None),
    "numpy.fromfile": (0, "file", None), "torch.load": (0, "f", None),
    "torch.serialization.load": (0, "f", None), "safetensors.safe_open": (0, "filename", None),
    "safetensors.torch.load_file": (0, "filename", None), "netrc.netrc": (0, "file", "~/.netrc"),
    **{f"shutil.{n}": (0, "src", None) for n in ("copy", "copy2", "copyfile", "copytree")},
}  # fmt: skip
#: Methods of a path that read it (``Path(...).read_text()``): the receiver is the target.
PATH_READ_METHODS = frozenset({"read_text", "read_bytes", "iterdir", "glob", "rglob"})
#: ``os.environ`` methods that read one variable (its name first) or the whole environment.
ENV_KEY_READS = frozenset({"get", "pop", "setdefault", "__getitem__", "__contains__"})
ENV_WHOLE_READS = frozenset({"copy", "items", "keys", "values", "__iter__", "__or__",
                              "__ror__", "__repr__"})  # fmt: skip
TEMP_WRITERS = frozenset(f"tempfile.{n}" for n in (
    "NamedTemporaryFile", "TemporaryFile", "SpooledTemporaryFile", "mkstemp", "mkdtemp",
    "TemporaryDirectory", "mktemp"))  # fmt: skip
#: Methods of a path (``Path(...).write_text``): the receiver is the target.
PATH_WRITE_METHODS = frozenset({"write_text", "write_bytes", "touch", "mkdir", "unlink", "rmdir",
                                 "symlink_to", "hardlink_to"})  # fmt: skip
PATH_MAYBE_WRITE_METHODS = frozenset({"rename", "replace", "chmod"})  # only on a sure path
#: transformers hooks that write into the folder their caller passes.
SAVE_HOOKS = frozenset({"save_vocabulary", "save_pretrained", "_save_pretrained", "save_config",
                         "to_json_file"})  # fmt: skip
#: Modules whose attributes, when assigned, change the whole process.
PATCHABLE = frozenset(sys.stdlib_module_names) | {"transformers", "huggingface_hub"}
PATCHABLE_CONTAINERS = {
    "os.environ": "writes an environment variable of the whole process",
    "os.environb": "writes an environment variable of the whole process",
    "sys.modules": "changes sys.modules, the module table of the whole process",
    "sys.path": "changes where every import looks",
    "sys.meta_path": "changes how every import is found",
    "sys.path_hooks": "changes how every import is found",
    "builtins.__dict__": "patches builtins for the whole process",
}
BUILTINS = frozenset(dir(builtins))


def match_rules(qual: str, *, called: bool) -> list[tuple[str, str]]:
    """The (category, reason) of every rule ``qual`` matches."""
    found = list(_RULES.get(qual, ()))
    if called:
        parts = qual.split(".")
        for end in range(len(parts) - 1, 0, -1):
            found += _RULES.get(".".join(parts[:end]) + ".*", ())
    top, last = qual.split(".", 1)[0], qual.rsplit(".", 1)[-1]
    if top == "huggingface_hub" and last in _HUB_DOWNLOADS:
        found.append(("network", "downloads from the Hugging Face Hub"))
    if top == "transformers" and last in _TRANSFORMERS_DOWNLOADS:
        found.append(("network", "downloads from the Hugging Face Hub"))
    if top == "transformers" and last in _TRANSFORMERS_DYNAMIC:
        found.append(("dynamic-code", "fetches and runs another repo's remote code"))
        found.append(("network", "downloads another repo's remote code"))
    return found
