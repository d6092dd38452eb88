"""ds_loongforge: fast Mixture-of-Experts training as a DeepSpeed integration.

    pip install .                      # ops are JIT-compiled with ninja on first use
    LF_BUILD_OPS=1 pip install .       # prebuild every compatible op
    LF_BUILD_RMSNORM=1 pip install .   # prebuild one op family (LF_BUILD_<OP>, see op_builder/)

Prebuilding needs torch, DeepSpeed and pydantic already installed in the build environment
(pip install --no-build-isolation), like DeepSpeed's own DS_BUILD_OPS.
"""

import os
import sys

from setuptools import Command, setup
from setuptools.command.build import build
from setuptools.command.develop import develop

ROOT = os.path.dirname(os.path.abspath(__file__))
# site processes .pth files in name order; this name sorts after those that put the package on sys.path
# ("__editable__.ds_loongforge-*.pth" of pip install -e, "easy-install.pth" of a legacy setup.py develop)
AUTOLOAD_PTH = "loongforge_autoload.pth"

PACKAGES = [
    "ds_loongforge",
    "ds_loongforge.ops",
    "ds_loongforge.modules",
    "ds_loongforge.optim",
    "ds_loongforge.data",
    "ds_loongforge.integrations",
    "ds_loongforge.integrations.presets",
    "ds_loongforge._ops",
    "ds_loongforge.op_builder",
    "ds_loongforge.csrc",
]
PACKAGE_DIR = {"ds_loongforge.op_builder": "op_builder", "ds_loongforge.csrc": "csrc"}


def prebuilt_extensions():
    """Extensions for LF_BUILD_OPS=1 / LF_BUILD_<OP>=1; [] (pure JIT install) otherwise."""
    build_all = os.environ.get("LF_BUILD_OPS") == "1"
    sys.path.insert(0, ROOT)
    try:
        from op_builder.builder import all_builders, visible_gpu_archs
    except ImportError as err:
        if build_all or any(k.startswith("LF_BUILD_") and v == "1" for k, v in os.environ.items()):
            raise RuntimeError(
                f"prebuilding ds_loongforge ops needs torch and deepspeed in the build environment ({err}); "
                "install them first and use pip install --no-build-isolation") from err
        return [], {}
    finally:
        sys.path.pop(0)
    extensions = []
    for builder in all_builders():
        if not (build_all or os.environ.get(builder.BUILD_VAR) == "1"):
            continue
        if not builder.is_compatible(verbose=True):
            print(f"[ds_loongforge] not prebuilding {builder.NAME}: {builder.error_log}")
            continue
        if builder.is_cuda_op and not os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip() and not visible_gpu_archs():
            print(f"[ds_loongforge] not prebuilding {builder.NAME}: no GPU is visible and TORCH_CUDA_ARCH_LIST is "
                  "unset, so the target architecture is unknown (set it, e.g. TORCH_CUDA_ARCH_LIST=9.0)")
            continue
        ext = builder.builder()
        ext.sources = [os.path.relpath(s, ROOT) for s in ext.sources]
        extensions.append(ext)
        print(f"[ds_loongforge] prebuilding {builder.NAME}")
    if not extensions:
        return [], {}
    from torch.utils.cpp_extension import BuildExtension

    return extensions, {"build_ext": BuildExtension}


class BuildAutoloadPth(Command):
    """Put loongforge_autoload.pth at the root of site-packages (config-only enablement: it imports
    ds_loongforge._autoload, which wraps deepspeed.initialize when deepspeed is imported). A regular build
    copies it into build_lib, which becomes the wheel root; an editable build (pip install -e) writes it
    into the unpacked editable wheel's root, which setuptools points install_lib at."""

    description = "install the ds_loongforge config-only autoload .pth"
    user_options = []
    editable_mode = False

    def initialize_options(self):
        self.build_lib = None

    def finalize_options(self):
        self.set_undefined_options("build", ("build_lib", "build_lib"))

    def run(self):
        if self.editable_mode:
            target = self.get_finalized_command("install").install_lib
        else:
            target = self.build_lib
        self.mkpath(target)
        self.copy_file(os.path.join(ROOT, AUTOLOAD_PTH), os.path.join(target, AUTOLOAD_PTH))

    def get_outputs(self):
        return [os.path.join(self.build_lib, AUTOLOAD_PTH)]


class BuildWithAutoloadPth(build):
    sub_commands = [*build.sub_commands, ("build_autoload_pth", None)]


class DevelopWithAutoloadPth(develop):
    """Legacy editable install (pip without PEP 660 support for this project runs `setup.py develop`, which
    has no build step): copy the .pth into site-packages too. Newer setuptools' develop runs
    `pip install -e`, which goes through BuildAutoloadPth, and leaves install_dir unset."""

    def run(self):
        super().run()
        if self.install_dir and not getattr(self, "uninstall", False):
            self.copy_file(os.path.join(ROOT, AUTOLOAD_PTH), os.path.join(self.install_dir, AUTOLOAD_PTH))


ext_modules, cmdclass = prebuilt_extensions()
cmdclass = {**cmdclass, "build": BuildWithAutoloadPth, "build_autoload_pth": BuildAutoloadPth,
            "develop": DevelopWithAutoloadPth}

setup(
    name="ds_loongforge",
    version="0.1.0",
    description="DeepSpeed integration for fast Mixture-of-Experts training: fused ops, expert-masked MoE, "
    "fused AdamW+clip, expert-aware sampling",
    python_requires=">=3.10",
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    package_data={"ds_loongforge.csrc": ["*/*.h", "*/*.cuh", "*/*.cu", "*/*.cpp"]},
    install_requires=[
        "torch>=2.9",
        "deepspeed>=0.19.8,<0.20",
        "transformers>=5.0",
        "datasets",
        "ninja",
        "numpy",
        "scikit-learn",
        "scipy",  # the sampler's batch partition (linear_sum_assignment); scikit-learn needs it too
        "pydantic>=2",
        "tqdm",
    ],
    # accelerate: the HF Trainer test; matplotlib: the benchmarks' plots (bench_e2e's smoke test draws one)
    extras_require={"test": ["pytest", "accelerate", "matplotlib", "peft==0.21.2"], "bench": ["matplotlib"]},
    entry_points={"console_scripts": ["loongforge_report=ds_loongforge.report:main",
                                        "loongforge_export=ds_loongforge.export:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
