"""Build steps that pyproject.toml cannot express:

* ``cpu_opt._native``: the C kernels in native/, compiled by cffi (native/build_native.py);
* ``cpu_opt/dnnl/_cdef_generated.py``: the cffi cdef of the oneDNN C API, generated from the
  oneDNN headers found at build time (cpu_opt/dnnl/cdefgen.py). Without headers (aarch64, where
  no oneDNN wheel exists) nothing is generated and cpu_opt runs without its own oneDNN binding.
"""
import importlib.util
import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _load_cdefgen():
    spec = importlib.util.spec_from_file_location("_cpu_opt_cdefgen", ROOT / "cpu_opt" / "dnnl" / "cdefgen.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class BuildPyWithDnnlCdef(build_py):
    def run(self):
        super().run()
        cdefgen = _load_cdefgen()
        include = cdefgen.find_include_dir()
        if include is None:
            print("cpu_opt: oneDNN headers not found; building without the oneDNN binding cdef")
            return
        targets = [Path(self.build_lib) / "cpu_opt" / "dnnl" / "_cdef_generated.py"]
        if getattr(self, "editable_mode", False) or os.environ.get("CPU_OPT_INPLACE"):
            targets = [ROOT / "cpu_opt" / "dnnl" / "_cdef_generated.py"]
        for t in targets:
            t.parent.mkdir(parents=True, exist_ok=True)
            ver = cdefgen.write_module(t, include)
            print(f"cpu_opt: generated {t} from oneDNN {ver} headers in {include}")


setup(
    cffi_modules=["native/build_native.py:ffibuilder"],
    cmdclass={"build_py": BuildPyWithDnnlCdef},
)
