"""Builds the relayed path's connect() shim, libmuster-netshim.so (muster/net/shim/netshim.c),
next to muster/net when muster is installed. Everything else is in pyproject.toml.

The shim is a plain shared library for LD_PRELOAD, not a Python module: it is built as an
extension only to ride setuptools' compiler set-up. Where no C compiler exists muster still
installs, says so, and its agents do not offer the relayed path (muster.net.shim)."""

from __future__ import annotations

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SHIM = "muster.net.libmuster_netshim"


class BuildShim(build_ext):
    def get_ext_filename(self, fullname: str) -> str:
        # (called with the full dotted name, or with its last part alone)
        if fullname in (SHIM, SHIM.rsplit(".", 1)[-1]):
            name = "libmuster-netshim.so"
            return name if "." not in fullname else os.path.join("muster", "net", name)
        return super().get_ext_filename(fullname)

    def get_export_symbols(self, ext: Extension) -> list[str]:
        return [] if ext.name == SHIM else super().get_export_symbols(ext)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # no compiler, no libc headers: install without the shim
            print(
                f"muster: could not build libmuster-netshim.so ({exc}); muster works without "
                "it, but this machine's agents cannot join a relayed gang. Install a C "
                "compiler (Debian: apt-get install gcc libc6-dev) and reinstall muster",
                file=sys.stderr,
            )


setup(
    ext_modules=[
        Extension(
            SHIM,
            sources=["muster/net/shim/netshim.c"],
            extra_compile_args=["-O2", "-fPIC", "-Wall", "-fvisibility=default"],
            libraries=["dl", "pthread"],
            optional=True,
        )
    ]
    if sys.platform.startswith("linux")
    else [],
    cmdclass={"build_ext": BuildShim},
)
