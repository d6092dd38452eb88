"""Shared base of the ds_loongforge op builders, on top of DeepSpeed's OpBuilder classes.

DeepSpeed's own ``load()`` only knows DeepSpeed's ops (it looks them up in
``deepspeed.git_version_info.installed_ops``), so each of our builders adds:

* absolute source paths under ``csrc/`` (found beside this package in a checkout, or in the
  installed ``ds_loongforge/csrc`` package data);
* ``load()``: import the module that ``LF_BUILD_OPS=1 pip install .`` prebuilt into
  ``ds_loongforge._ops``, else JIT-compile it with ninja (cached by torch under
  ``TORCH_EXTENSIONS_DIR``);
* a CUDA JIT build that does not depend on a GPU being visible, so CI can compile CUDA ops on a
  CPU-only machine (DeepSpeed's ``jit_load`` silently switches to a CPU build there);
* :class:`OpBuildError`, naming the op, the last compiler lines and the likely fix.

Compatibility checks never initialise CUDA, so importing a builder is always safe.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from deepspeed.ops.op_builder.builder import CUDAOpBuilder, OpBuilder, installed_cuda_version
from deepspeed.ops.op_builder.cpu.builder import CPUOpBuilder

PREBUILT_PACKAGE = "ds_loongforge._ops"
_LAST_COMPILER_LINES = 25


class OpBuildError(RuntimeError):
    """An op could not be built or loaded; the message says which op, why, and how to fix it."""

    def __init__(self, op_name: str, reason: str, fix: str, compiler_tail: str = ""):
        self.op_name = op_name
        self.reason = reason
        self.fix = fix
        self.compiler_tail = compiler_tail
        message = f"ds_loongforge op '{op_name}' could not be built: {reason}\n  fix: {fix}"
        if compiler_tail:
            message += f"\n  last compiler lines:\n{compiler_tail}"
        super().__init__(message)


def csrc_root() -> Path:
    """Directory holding the C++/CUDA sources: ``<checkout>/csrc`` or ``ds_loongforge/csrc``."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "csrc", here.parent / "ds_loongforge" / "csrc"):
        if (candidate / "includes" / "lf_common.h").is_file():
            return candidate
    raise FileNotFoundError(
        f"ds_loongforge C++ sources not found next to {here} (looked for csrc/includes/lf_common.h); "
        "reinstall the package so its csrc/ package data is present")


def _tail(text: str, n: int = _LAST_COMPILER_LINES) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return "\n".join("    " + line for line in lines[-n:])


def _likely_fix(output: str, is_cuda: bool) -> str:
    low = output.lower()
    if "ninja is required" in low or "ninja: not found" in low or "ninja: command not found" in low:
        return "install ninja (pip install ninja) and make sure `ninja --version` runs"
    if is_cuda and ("nvcc: not found" in low or "bin/nvcc: no such file" in low):
        return "set CUDA_HOME to a CUDA toolkit with bin/nvcc matching torch.version.cuda"
    if "fatal error:" in low and "no such file or directory" in low:
        return ("a header is missing: install the development headers it names (for CUDA headers, the full "
                "CUDA toolkit under CUDA_HOME; for Python.h, the python3-dev package)")
    if "unsupported gpu architecture" in low or "unsupported arch" in low:
        return "set TORCH_CUDA_ARCH_LIST to architectures your nvcc supports (e.g. 9.0 for H100/H200)"
    if any(m in low for m in ("permission denied", "operation not permitted", "read-only file system",
                               "not a directory")):
        return "set TORCH_EXTENSIONS_DIR to a writable directory"
    if "undefined symbol" in low:
        return ("the module was built against another torch version: remove the stale build "
                "(TORCH_EXTENSIONS_DIR or reinstall with LF_BUILD_OPS=1) and rebuild")
    return ("read the compiler lines below; check that the C++ compiler (c++ --version), CUDA_HOME/nvcc "
            "and torch.version.cuda agree, then retry (LOONGFORGE_VERBOSE_BUILD=1 prints the full log)")


class LoongForgeBuilderMixin:
    """What every ds_loongforge builder shares. Subclasses set NAME, BUILD_VAR and SOURCES."""

    NAME: str = ""
    BUILD_VAR: str = ""
    SOURCES: tuple[str, ...] = ()
    _loaded: dict[str, object] = {}
    _host_flags: dict[str, str] = {}  # per process: the host does not change under us

    # DeepSpeed asks py-cpuinfo afresh on every call (about 1.2 s each, 8 calls per op load, also when
    # the op is already compiled and only its cache key is checked): ask once per process
    def cpu_arch(self):
        if "cpu_arch" not in self._host_flags:
            self._host_flags["cpu_arch"] = super().cpu_arch()
        return self._host_flags["cpu_arch"]

    def simd_width(self):
        if "simd_width" not in self._host_flags:
            self._host_flags["simd_width"] = super().simd_width()
        return self._host_flags["simd_width"]

    def absolute_name(self) -> str:
        return f"{PREBUILT_PACKAGE}.{self.NAME}"

    def sources(self) -> list[str]:
        root = csrc_root()
        return [str(root / s) for s in self.SOURCES]

    def include_paths(self) -> list[str]:
        return [str(csrc_root() / "includes")]

    @property
    def is_cuda_op(self) -> bool:
        return isinstance(self, CUDAOpBuilder)

    def prebuilt_module(self):
        """The module setup.py built, or None when it was not prebuilt."""
        try:
            return importlib.import_module(self.absolute_name())
        except ModuleNotFoundError as err:
            if err.name in (self.absolute_name(), PREBUILT_PACKAGE):
                return None
            raise
        except ImportError as err:
            raise OpBuildError(self.NAME, f"the prebuilt module failed to import ({err})",
                               _likely_fix(str(err), self.is_cuda_op)) from err

    def jit_cached(self) -> bool:
        """True when a JIT build of this op already sits in torch's extension cache."""
        from torch.utils.cpp_extension import _get_build_directory

        try:
            build_dir = Path(_get_build_directory(self.NAME, verbose=False))  # creates the folder
        except OSError:  # a cache folder that cannot be created holds nothing; a build says why
            return False
        return any(build_dir.glob(f"{self.NAME}*.so"))

    def load(self, verbose: bool = False):
        if self.NAME in LoongForgeBuilderMixin._loaded:
            return LoongForgeBuilderMixin._loaded[self.NAME]
        module = self.prebuilt_module()
        if module is None:
            module = self.jit_build(verbose=verbose)
        LoongForgeBuilderMixin._loaded[self.NAME] = module
        return module

    def compatibility_problem(self) -> str | None:
        """Why this op cannot be built here, or None. Never initialises CUDA."""
        if shutil.which(os.environ.get("CXX", "c++")) is None:
            return "no C++ compiler found (install g++ or set CXX)"
        return None

    def is_compatible(self, verbose: bool = False) -> bool:
        problem = self.compatibility_problem()
        if problem is not None:
            self.error_log = problem
            if verbose:
                self.warning(problem)
        return problem is None

    def jit_build(self, verbose: bool = False):
        """Compile with ninja into torch's extension cache and import the result."""
        problem = self.compatibility_problem()
        if problem is not None:
            raise OpBuildError(self.NAME, problem, _fix_for_problem(problem))
        from torch.utils.cpp_extension import load, verify_ninja_availability

        with environment_ninja():
            try:
                verify_ninja_availability()
            except RuntimeError as err:
                raise OpBuildError(self.NAME, "ninja is not available",
                                   "install ninja (pip install ninja) and make sure `ninja --version` runs") from err
            if self.is_cuda_op and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
                import torch

                if not torch.cuda.is_available():
                    raise OpBuildError(self.NAME, "no CUDA device is visible and TORCH_CUDA_ARCH_LIST is unset, so the "
                                       "target GPU architecture is unknown",
                                       "set TORCH_CUDA_ARCH_LIST to the GPU's compute capability (e.g. 9.0 for "
                                       "H100/H200) to compile without a GPU")
            verbose = verbose or os.environ.get("LOONGFORGE_VERBOSE_BUILD") == "1"
            saved_jit_mode = self.jit_mode
            self.jit_mode = True  # CUDA arch flags then come from torch (LFCUDAOpBuilder.compute_capability_args)
            self.build_for_cpu = not self.is_cuda_op
            try:
                module = load(name=self.NAME,
                              sources=self.sources(),
                              extra_include_paths=self.include_paths(),
                              extra_cflags=self.strip_empty_entries(self.cxx_args()),
                              extra_cuda_cflags=self.strip_empty_entries(self.nvcc_args()) if self.is_cuda_op else [],
                              extra_ldflags=self.strip_empty_entries(self.extra_ldflags()),
                              with_cuda=self.is_cuda_op,
                              verbose=verbose)
            except (RuntimeError, OSError, subprocess.CalledProcessError, ImportError) as err:
                output = str(err)
                reason = f"{type(err).__name__} during the JIT build"
                if isinstance(err, OSError):  # the cache not writable: one line, shown where the tail is not
                    reason += f" ({err})"
                raise OpBuildError(self.NAME, reason,
                                   _likely_fix(output, self.is_cuda_op), _tail(output)) from err
            finally:
                self.jit_mode = saved_jit_mode
            return module


_NINJA_LOCK = threading.Lock()
_ninja_users = 0
_path_before_ninja: str | None = None


def environment_ninja_dir() -> str | None:
    """The folder of the ``ninja`` executable the ``ninja`` package installed into this Python environment, or
    None when there is none (then torch runs whichever ``ninja`` PATH finds)."""
    try:
        import ninja
    except ImportError:
        return None
    folder = getattr(ninja, "BIN_DIR", "") or ""
    exe = os.path.join(folder, "ninja" + (".exe" if os.name == "nt" else ""))
    return folder if folder and os.path.isfile(exe) and os.access(exe, os.X_OK) else None


def path_with_environment_ninja(path: str | None) -> str | None:
    """``path`` (a PATH value, None when unset) with this environment's ninja folder first; None when the
    environment has no ninja of its own (PATH is then left alone)."""
    folder = environment_ninja_dir()
    if folder is None:
        return None
    return os.pathsep.join([folder, path]) if path else folder


@contextlib.contextmanager
def environment_ninja():
    """Put this environment's ninja first on PATH while torch JIT-builds (torch runs ``ninja`` from PATH).

    A machine often has two ninjas: the system's (1.11 here) and the ``ninja`` package's in the environment
    (1.13). Each writes ``.ninja_log`` in its own format, and 1.13 hashes commands another way, so a build
    folder last built by the other one counts every command as changed and is rebuilt from scratch: every op,
    each time a process run from an activated environment (the ``deepspeed`` launcher, pytest in CI) follows
    one that was not (``.venv/bin/python train.py``), tens of seconds per CPU op and minutes per CUDA op. With
    one ninja per environment the cache holds. PATH is restored when the last concurrent build ends."""
    global _ninja_users, _path_before_ninja
    with _NINJA_LOCK:
        if _ninja_users == 0:
            _path_before_ninja = os.environ.get("PATH")
            pinned = path_with_environment_ninja(_path_before_ninja)  # None: no ninja of its own, PATH as it is
            if pinned is not None:
                os.environ["PATH"] = pinned
        _ninja_users += 1
    try:
        yield
    finally:
        with _NINJA_LOCK:
            _ninja_users -= 1
            if _ninja_users == 0:
                if _path_before_ninja is None:
                    os.environ.pop("PATH", None)
                else:
                    os.environ["PATH"] = _path_before_ninja


def _fix_for_problem(problem: str) -> str:
    if "CUDA_HOME" in problem or "nvcc" in problem:
        return ("install a CUDA toolkit whose version matches torch.version.cuda and set CUDA_HOME "
                "(e.g. CUDA_HOME=/usr/local/cuda)")
    if "CUDA build of torch" in problem:
        return "install a CUDA build of torch (the CPU op still works on CPU tensors)"
    if "compiler" in problem:
        return "install g++ (apt-get install g++) or point CXX at a C++17/20 compiler"
    return "see the reason above"


def _without_debug_info(args: list[str]) -> list[str]:
    """DeepSpeed compiles host code with -g; debug info of torch's headers makes a cold build of the
    bindings markedly slower and the modules larger, and nobody steps through them."""
    return [a for a in args if a != "-g"]


class LFCPUOpBuilder(LoongForgeBuilderMixin, CPUOpBuilder):
    """A host op: the CPU kernels, compiled with OpenMP and the host's vector width."""

    def __init__(self):
        CPUOpBuilder.__init__(self, name=self.NAME)

    def cxx_args(self):
        return _without_debug_info(super().cxx_args()) + ["-std=c++20"]


class LFCUDAOpBuilder(LoongForgeBuilderMixin, CUDAOpBuilder):
    """A CUDA op. Compiles wherever torch is a CUDA build and nvcc matches it; runs only on a GPU."""

    def __init__(self):
        CUDAOpBuilder.__init__(self, name=self.NAME)

    def compatibility_problem(self) -> str | None:
        problem = super().compatibility_problem()
        if problem is not None:
            return problem
        import torch
        from torch.utils.cpp_extension import CUDA_HOME

        if torch.version.cuda is None:
            return f"torch {torch.__version__} is not a CUDA build of torch"
        if CUDA_HOME is None:
            return "CUDA_HOME is not set and no nvcc was found on PATH"
        try:
            major, minor = installed_cuda_version()
        except Exception as err:  # DeepSpeed raises its own exception types here
            return f"nvcc under CUDA_HOME={CUDA_HOME} did not run ({err})"
        torch_major = int(torch.version.cuda.split(".")[0])
        if major != torch_major:
            return (f"nvcc is CUDA {major}.{minor} but torch was built with CUDA {torch.version.cuda} "
                    "(CUDA_HOME must match torch's major version)")
        return None

    def compute_capability_args(self, cross_compile_archs=None):
        if self.jit_mode:
            # torch's cpp_extension turns TORCH_CUDA_ARCH_LIST into -gencode flags itself (or probes the
            # visible GPUs), and it understands arch-specific entries such as "9.0a" that DeepSpeed 0.19's
            # parser rejects with a ValueError.
            return []
        if cross_compile_archs is None and not os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip():
            # a prebuild (setup.py) without TORCH_CUDA_ARCH_LIST: DeepSpeed 0.19 would target its default list,
            # "6.0;6.1;7.0" under CUDA 13, whose nvcc rejects all three; build for the visible GPUs, as a JIT
            # build does (setup.py does not prebuild a CUDA op when there are none)
            cross_compile_archs = ";".join(visible_gpu_archs()) or None
        return super().compute_capability_args(cross_compile_archs)

    def cxx_args(self):
        return _without_debug_info(super().cxx_args()) + ["-DLF_WITH_CUDA"]

    def nvcc_args(self):
        return super().nvcc_args() + ["-DLF_WITH_CUDA", "--expt-relaxed-constexpr"]


def visible_gpu_archs() -> list[str]:
    """The compute capabilities ("9.0") of the visible CUDA devices, each once; [] without any."""
    import torch

    if not torch.cuda.is_available():
        return []
    return sorted({"%d.%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})


def _build_in_child(module_name: str, class_name: str, jobs: int | None = None) -> tuple[str, str, str] | None:
    """Runs in a spawned process: JIT-build one op into the shared cache (with ``jobs`` compilers at once, torch's
    MAX_JOBS, unless the user set it); the error's fields on failure."""
    if jobs is not None and not os.environ.get("MAX_JOBS"):
        os.environ["MAX_JOBS"] = str(jobs)
    builder = getattr(importlib.import_module(module_name), class_name)()
    try:
        builder.jit_build()
    except OpBuildError as err:
        return err.reason, err.fix, err.compiler_tail
    return None


def build_plan(pending: int, cpus: int | None = None, max_parallel: int | None = None) -> tuple[int, int]:
    """(ops built at once, compilers each op's ninja runs at once) for ``pending`` cold ops on ``cpus`` cores:
    at most one op per core, and about cores + 2 compilers in all (ninja's default for one build). Each ninja
    alone would start cores + 2 (torch's default MAX_JOBS): ten ops on 2 cores were ~30 compilers at up to ~1 GB
    each, past a small machine's memory."""
    cpus = max(1, cpus or os.cpu_count() or 1)
    workers = max(1, min(pending, max_parallel or cpus))
    return workers, max(1, -(-(cpus + 2) // workers))


def build_ops(builders: list, max_parallel: int | None = None) -> dict[str, object]:
    """Build several ops at once and load them: ``{NAME: module or OpBuildError}``.

    Ops that are neither prebuilt nor in the JIT cache are compiled concurrently, each in its own
    spawned process (one ninja per op), so a cold start costs the slowest op rather than the sum; the
    modules are then imported here from the cache. An op that fails does not stop the others. At most one op per
    core builds at a time (``max_parallel`` overrides), sharing about cores + 2 compilers (:func:`build_plan`;
    a MAX_JOBS in the environment wins).
    """
    pending = [b for b in builders if b.prebuilt_module() is None and not b.jit_cached()
               and b.compatibility_problem() is None]
    failures: dict[str, OpBuildError] = {}
    # a spawned child re-imports the parent's main script; one read from stdin ("<stdin>") cannot be, so
    # such a parent builds one op after the other below instead of failing
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if len(pending) > 1 and (main_file is None or os.path.exists(main_file)):
        context = multiprocessing.get_context("spawn")
        workers, jobs = build_plan(len(pending), max_parallel=max_parallel)
        with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
            futures = {b.NAME: pool.submit(_build_in_child, type(b).__module__, type(b).__qualname__, jobs)
                       for b in pending}
            for name, future in futures.items():
                error = future.result()
                if error is not None:
                    failures[name] = OpBuildError(name, *error)
    results: dict[str, object] = {}
    for builder in builders:
        if builder.NAME in failures:
            results[builder.NAME] = failures[builder.NAME]
            continue
        try:
            results[builder.NAME] = builder.load()
        except OpBuildError as err:
            results[builder.NAME] = err
    return results


def all_builders() -> list[OpBuilder]:
    from .adamw import FusedAdamWClipBuilder, FusedAdamWClipCPUBuilder
    from .cross_entropy import FusedCrossEntropyBuilder, FusedCrossEntropyCPUBuilder
    from .moe_dispatch import MoEDispatchBuilder, MoEDispatchCPUBuilder
    from .rmsnorm import FusedRMSNormBuilder, FusedRMSNormCPUBuilder
    from .swiglu import FusedSwiGLUBuilder, FusedSwiGLUCPUBuilder

    return [FusedRMSNormBuilder(), FusedRMSNormCPUBuilder(), FusedSwiGLUBuilder(), FusedSwiGLUCPUBuilder(),
            MoEDispatchBuilder(), MoEDispatchCPUBuilder(), FusedAdamWClipBuilder(), FusedAdamWClipCPUBuilder(),
            FusedCrossEntropyBuilder(), FusedCrossEntropyCPUBuilder()]


def cuda_builders() -> list[OpBuilder]:
    """The CUDA ops' builders of :func:`all_builders` (what a GPU run prebuilds)."""
    return [b for b in all_builders() if isinstance(b, LFCUDAOpBuilder)]
