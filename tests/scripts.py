"""Load a script of benchmarks/ as a module, so tests call its main(argv) in-process."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).parents[1]


def load_script(relpath, name):
    spec = importlib.util.spec_from_file_location(name, ROOT / relpath)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
