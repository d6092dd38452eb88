"""The op builders: names, paths, prebuilt import, JIT build, failure messages, fallback and strict mode."""

import os
import subprocess
import sys
import textwrap
import uuid
import warnings
from pathlib import Path

import pytest
import torch

import ds_loongforge
from ds_loongforge.op_builder import (FusedRMSNormBuilder, FusedRMSNormCPUBuilder, OpBuildError, all_builders,
                                      csrc_root)
from ds_loongforge.op_builder.builder import (LFCPUOpBuilder, LoongForgeBuilderMixin, environment_ninja,
                                              environment_ninja_dir)
from ds_loongforge.ops import _dispatch, fused_rmsnorm, rmsnorm_reference

REPO = Path(__file__).resolve().parents[1]


def test_builder_names_are_unique_and_paths_absolute():
    builders = all_builders()
    names = [b.NAME for b in builders]
    assert len(set(names)) == len(names)
    assert all(n.startswith("lf_") for n in names), "our NAMEs must not collide with DeepSpeed's ops"
    for b in builders:
        assert b.absolute_name() == f"ds_loongforge._ops.{b.NAME}"
        assert b.BUILD_VAR.startswith("LF_BUILD_")
        for path in b.sources() + b.include_paths():
            assert os.path.isabs(path) and os.path.exists(path), path


def test_compatibility_check_does_not_initialise_cuda():
    code = ("import torch; from ds_loongforge.op_builder import all_builders; "
            "[b.is_compatible() for b in all_builders()]; print(torch.cuda.is_initialized())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_cpu_op_jit_builds_loads_and_is_cached():
    builder = FusedRMSNormCPUBuilder()
    module = builder.load()
    assert module.device == "cpu" and hasattr(module, "forward") and hasattr(module, "backward")
    assert builder.jit_cached()
    assert FusedRMSNormCPUBuilder().load() is module


def _broken_builder(tmp_path, body):
    source = tmp_path / "broken.cpp"
    source.write_text(body)

    class BrokenBuilder(LFCPUOpBuilder):
        NAME = f"lf_test_broken_{uuid.uuid4().hex[:8]}"
        BUILD_VAR = "LF_BUILD_TEST_BROKEN"
        SOURCES = (str(source),)

    return BrokenBuilder()


def test_broken_source_gives_op_name_compiler_lines_and_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    builder = _broken_builder(tmp_path, "#include <torch/extension.h>\nint broken( { return 0; }\n")
    with pytest.raises(OpBuildError) as info:
        builder.load()
    message = str(info.value)
    assert builder.NAME in message
    assert "error" in info.value.compiler_tail and "broken.cpp" in info.value.compiler_tail
    assert "fix:" in message


def test_unwritable_extensions_dir_names_the_fix(tmp_path, monkeypatch):
    """A TORCH_EXTENSIONS_DIR that cannot be written (read-only, not a folder) fell back with "PermissionError
    during the JIT build. Fix: read the compiler lines below; check that the C++ compiler ...", naming neither the
    folder nor the fix, and loongforge_report (and --verify) died in a traceback from the "JIT-cached" column."""
    (tmp_path / "file").write_text("")
    bad = tmp_path / "file" / "ext"  # a path under a regular file: unwritable even for root
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(bad))
    builder = _broken_builder(tmp_path, "")
    assert not builder.jit_cached()
    with pytest.raises(OpBuildError) as info:
        builder.load()
    assert str(bad) in info.value.reason and "TORCH_EXTENSIONS_DIR to a writable directory" in info.value.fix
    out = subprocess.run([sys.executable, "-m", "ds_loongforge.report"], capture_output=True, text=True,
                         env={**os.environ, "TORCH_EXTENSIONS_DIR": str(bad)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "cannot be written" in out.stdout and "set TORCH_EXTENSIONS_DIR to a writable directory" in out.stdout


def test_missing_ninja_says_install_ninja(tmp_path, monkeypatch):
    import torch.utils.cpp_extension as cpp_extension

    def no_ninja():
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp_extension, "verify_ninja_availability", no_ninja)
    builder = _broken_builder(tmp_path, "")
    with pytest.raises(OpBuildError, match="install ninja"):
        builder.load()


def test_builds_run_the_environments_ninja_and_restore_path(monkeypatch):
    folder = environment_ninja_dir()
    if folder is None:
        pytest.skip("the ninja package installs no ninja executable into this environment (.ci/run installs it)")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    with environment_ninja():
        assert os.environ["PATH"].split(os.pathsep)[0] == folder
        with environment_ninja():  # a second build at the same time (build_ops' threads) keeps it
            pass
        assert os.environ["PATH"].split(os.pathsep)[0] == folder
    assert os.environ["PATH"] == "/usr/bin:/bin"
    monkeypatch.delenv("PATH")
    with environment_ninja():
        assert os.environ["PATH"] == folder
    assert "PATH" not in os.environ


_TINY_MODULE = textwrap.dedent("""\
    #include <Python.h>
    #define LF_CONCAT(a, b) a##b
    #define LF_INIT(name) LF_CONCAT(PyInit_, name)
    #define LF_STR(x) #x
    #define LF_NAME(x) LF_STR(x)
    static struct PyModuleDef lf_def = {PyModuleDef_HEAD_INIT, LF_NAME(TORCH_EXTENSION_NAME), NULL, -1, NULL};
    PyMODINIT_FUNC LF_INIT(TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&lf_def); }
""")

_BUILD_TINY = textwrap.dedent("""\
    import sys
    from ds_loongforge.op_builder.builder import LFCPUOpBuilder

    class Tiny(LFCPUOpBuilder):
        NAME = "lf_test_tiny_ninja"
        BUILD_VAR = "LF_BUILD_TEST_TINY"
        SOURCES = (sys.argv[1],)

    Tiny().load()
""")


def test_jit_cache_holds_whichever_ninja_path_finds_first(tmp_path):
    """A process whose PATH finds the system's ninja first, then one whose PATH finds the environment's: the
    second reuses the first's build. Two ninja releases (1.11 in /usr/bin, 1.13 from pip, on this machine and
    CI's) read each other's .ninja_log as "every command changed", which rebuilt every op whenever an activated
    environment followed an unactivated one."""
    source = tmp_path / "tiny.c"
    source.write_text(_TINY_MODULE)
    ext = tmp_path / "ext"
    env_bin = str(Path(sys.executable).parent)

    def build(path):
        env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(ext), PATH=path)
        done = subprocess.run([sys.executable, "-c", _BUILD_TINY, str(source)], env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        so = next(ext.glob("lf_test_tiny_ninja*/lf_test_tiny_ninja*.so"))
        return so.stat().st_mtime_ns, (so.parent / ".ninja_log").read_text()

    system_first = os.pathsep.join(["/usr/bin", "/bin", env_bin])
    built, log = build(system_first)
    assert build(os.pathsep.join([env_bin, system_first])) == (built, log)
    assert build(system_first) == (built, log)


def test_cuda_op_without_gpu_or_arch_list_names_the_fix(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here, so the architecture is known")
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    builder = FusedRMSNormBuilder()
    if builder.compatibility_problem() is not None:
        with pytest.raises(OpBuildError, match=builder.compatibility_problem()[:20]):
            builder.jit_build()
    else:
        with pytest.raises(OpBuildError, match="TORCH_CUDA_ARCH_LIST"):
            builder.jit_build()


@pytest.fixture
def failing_cpu_rmsnorm(monkeypatch):
    def fail(self, verbose=False):
        raise OpBuildError(self.NAME, "simulated compiler failure", "install the simulated compiler")

    monkeypatch.setattr(FusedRMSNormCPUBuilder, "load", fail)
    _dispatch.forget_failures()
    yield
    _dispatch.forget_failures()
    _dispatch.set_strict_ops(None)


def test_auto_falls_back_to_reference_with_one_warning(failing_cpu_rmsnorm, monkeypatch):
    monkeypatch.delenv("LOONGFORGE_STRICT_OPS", raising=False)
    x, w = torch.randn(4, 32), torch.randn(32)
    with pytest.warns(RuntimeWarning, match="lf_fused_rmsnorm_cpu.*simulated compiler failure.*install the simulated"):
        y = fused_rmsnorm(x, w)
    torch.testing.assert_close(y, rmsnorm_reference(x, w))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fused_rmsnorm(x, w)  # a second call is silent
    with pytest.raises(OpBuildError, match="simulated"):
        fused_rmsnorm(x, w, impl="cpu")  # an explicit impl never falls back


def test_strict_ops_env_makes_a_failed_build_an_error(failing_cpu_rmsnorm, monkeypatch):
    monkeypatch.setenv("LOONGFORGE_STRICT_OPS", "1")
    with pytest.raises(OpBuildError, match="simulated compiler failure"):
        fused_rmsnorm(torch.randn(2, 8), torch.ones(8))


def test_strict_ops_config_makes_a_failed_build_an_error(failing_cpu_rmsnorm, monkeypatch):
    from ds_loongforge.config import apply_op_settings, parse_config

    monkeypatch.delenv("LOONGFORGE_STRICT_OPS", raising=False)
    apply_op_settings(parse_config({"loongforge": {"enabled": True, "strict_ops": True}}))
    with pytest.raises(OpBuildError):
        fused_rmsnorm(torch.randn(2, 8), torch.ones(8))


def test_bad_impl_is_a_clear_error():
    with pytest.raises(ValueError, match="impl='gpu' is not one of"):
        fused_rmsnorm(torch.randn(2, 8), torch.ones(8), impl="gpu")
    with pytest.raises(ValueError, match="tensors are on 'cpu'"):
        fused_rmsnorm(torch.randn(2, 8), torch.ones(8), impl="cuda")


@pytest.mark.slow
def test_setup_py_prebuilds_an_op_that_load_imports(tmp_path):
    """LF_BUILD_RMSNORM=1 through setup.py builds the op; load() then imports it without any JIT."""
    env = dict(os.environ, LF_BUILD_RMSNORM="1", CUDA_HOME=str(tmp_path / "no-cuda"),
               TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
                    "--build-temp", str(tmp_path / "tmp")], cwd=REPO, env=env, check=True,
                   capture_output=True, text=True)
    built = list((tmp_path / "lib" / "ds_loongforge" / "_ops").glob("lf_fused_rmsnorm_cpu*.so"))
    assert built, "setup.py did not produce the prebuilt module"
    probe = textwrap.dedent(f"""
        import ds_loongforge._ops as ops_pkg
        ops_pkg.__path__.append({str(built[0].parent)!r})
        from ds_loongforge.op_builder import FusedRMSNormCPUBuilder
        def no_jit(self, verbose=False):
            raise AssertionError("JIT build attempted although a prebuilt module exists")
        FusedRMSNormCPUBuilder.jit_build = no_jit
        module = FusedRMSNormCPUBuilder().load()
        import torch
        y, _, _ = module.forward(torch.ones(2, 8), None, torch.ones(8), 0.0, True)
        assert torch.allclose(y, torch.ones(2, 8))
        print(module.__file__)
    """)
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1].startswith(str(built[0].parent))


def test_prebuild_without_arch_list_targets_the_visible_gpus(monkeypatch):
    """LF_BUILD_OPS=1 pip install without TORCH_CUDA_ARCH_LIST (documented as needed only without a visible GPU)
    compiled the CUDA ops for DeepSpeed 0.19's default archs, 6.0;6.1;7.0 under CUDA 13, which nvcc 13 rejects
    ("Unsupported gpu architecture 'compute_60'"): the install failed, with a GPU or without."""
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (9, 0))
    builder = FusedRMSNormBuilder()
    builder.jit_mode = False
    args = builder.compute_capability_args()
    assert args and all("compute_90" in a for a in args) and not any("compute_60" in a for a in args), args
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0")  # the user's list still wins
    assert all("compute_80" in a for a in builder.compute_capability_args())


def test_setup_py_without_gpu_or_arch_list_skips_the_cuda_ops_and_says_why(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the CUDA ops are prebuilt for it")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CUDA_ARCH_LIST"}
    out = subprocess.run([sys.executable, "setup.py", "--name"], cwd=REPO, env={**env, "LF_BUILD_RMSNORM": "1"},
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "] prebuilding lf_fused_rmsnorm_cpu\n" in out.stdout and "] prebuilding lf_fused_rmsnorm\n" not in out.stdout
    why = out.stdout.split("not prebuilding lf_fused_rmsnorm: ")[1].splitlines()[0]
    assert "TORCH_CUDA_ARCH_LIST is unset" in why or not FusedRMSNormBuilder().is_compatible(), why


@pytest.mark.cuda_build
def test_cuda_ops_compile():
    """nvcc compiles the CUDA ops (they cannot run without a GPU; the gpu-marked tests run them)."""
    missing = []
    if torch.version.cuda is None:
        missing.append("a CUDA build of torch (pip install torch==2.14.1)")
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        missing.append("TORCH_CUDA_ARCH_LIST (e.g. 9.0)")
    problem = FusedRMSNormBuilder().compatibility_problem()
    if problem:
        missing.append(problem)
    if missing:
        reason = "cannot compile CUDA ops here: needs " + "; ".join(missing)
        if os.environ.get("LOONGFORGE_REQUIRE_CUDA_BUILD") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    from ds_loongforge.op_builder import cuda_builders

    builders = cuda_builders()
    assert len(builders) == 5 and len(builders) * 2 == len(all_builders())  # every op has a CUDA and a CPU build
    for builder in builders:
        module = builder.load()
        assert module.device == "cuda"
        assert builder.jit_cached() or builder.prebuilt_module() is not None


def test_build_plan_bounds_the_compilers_by_the_cores(monkeypatch):
    """Ten cold ops on 2 cores ran ten ninjas of cores + 2 jobs each (~30 compilers, past a small machine's
    memory): build_ops builds at most one op per core with about cores + 2 compilers in all, a user's MAX_JOBS
    wins in the child."""
    from ds_loongforge.op_builder.builder import _build_in_child, build_plan

    assert build_plan(10, cpus=2) == (2, 2)
    assert build_plan(10, cpus=16) == (10, 2)
    assert build_plan(3, cpus=16) == (3, 6)
    assert build_plan(10, cpus=16, max_parallel=4) == (4, 5)
    assert build_plan(1, cpus=1) == (1, 3)
    for user, expected in ((None, "2"), ("7", "7")):
        if user is None:
            monkeypatch.delenv("MAX_JOBS", raising=False)
        else:
            monkeypatch.setenv("MAX_JOBS", user)
        seen = {}
        monkeypatch.setattr(FusedRMSNormCPUBuilder, "jit_build",
                            lambda self: seen.setdefault("jobs", os.environ["MAX_JOBS"]))
        assert _build_in_child(FusedRMSNormCPUBuilder.__module__, FusedRMSNormCPUBuilder.__qualname__, 2) is None
        assert seen["jobs"] == expected


@pytest.mark.slow
def test_build_ops_builds_concurrently_and_isolates_a_failure(tmp_path, monkeypatch):
    """build_ops compiles cold ops in parallel processes, loads them, and reports a broken op by itself."""
    from ds_loongforge.op_builder import FusedSwiGLUCPUBuilder, build_ops

    pkg = tmp_path / "lf_broken_ops"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(f"""
        from ds_loongforge.op_builder.builder import LFCPUOpBuilder

        class BrokenBuilder(LFCPUOpBuilder):
            NAME = "lf_test_broken_parallel"
            BUILD_VAR = "LF_BUILD_TEST_BROKEN"
            SOURCES = ({str(tmp_path / 'broken.cpp')!r},)
    """))
    (tmp_path / "broken.cpp").write_text("int broken( {\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(LoongForgeBuilderMixin, "_loaded", {})
    import lf_broken_ops

    builders = [FusedRMSNormCPUBuilder(), FusedSwiGLUCPUBuilder(), lf_broken_ops.BrokenBuilder()]
    results = build_ops(builders)
    assert results["lf_fused_rmsnorm_cpu"].device == "cpu"
    assert results["lf_fused_swiglu_cpu"].device == "cpu"
    broken = results["lf_test_broken_parallel"]
    assert isinstance(broken, OpBuildError) and "broken.cpp" in broken.compiler_tail
    assert FusedRMSNormCPUBuilder().jit_cached() and FusedSwiGLUCPUBuilder().jit_cached()


def test_build_ops_from_a_stdin_script_builds_one_after_the_other(tmp_path):
    """A spawned child cannot re-import a main script read from stdin: build_ops must not fail there (it
    did on the device, run_gpu.sh feeding it through `python3 -`), but build the ops in this process."""
    for name in ("a", "b"):
        (tmp_path / f"broken_{name}.cpp").write_text("int broken( {\n")
    script = textwrap.dedent(f"""
        from ds_loongforge.op_builder.builder import LFCPUOpBuilder, OpBuildError, build_ops

        class BrokenA(LFCPUOpBuilder):
            NAME = "lf_test_stdin_a"
            BUILD_VAR = "LF_BUILD_TEST_STDIN"
            SOURCES = ({str(tmp_path / 'broken_a.cpp')!r},)

        class BrokenB(BrokenA):
            NAME = "lf_test_stdin_b"
            SOURCES = ({str(tmp_path / 'broken_b.cpp')!r},)

        results = build_ops([BrokenA(), BrokenB()])
        assert all(isinstance(r, OpBuildError) for r in results.values()), results
        print("both reported", sorted(results))
    """)
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    done = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "both reported ['lf_test_stdin_a', 'lf_test_stdin_b']" in done.stdout
