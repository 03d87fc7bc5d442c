# Ships crosspool_torchvision_guard.pth next to the module so that every
# interpreter of the environment installs the (cheap, lazy) import hook;
# `pip uninstall crosspool-torchvision-cpu-guard` removes both.
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "crosspool_torchvision_guard.pth"


class build_py_with_pth(build_py):
    def run(self):
        super().run()
        shutil.copy(os.path.join(os.path.dirname(__file__) or ".", PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": build_py_with_pth})
