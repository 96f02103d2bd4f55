"""Only the optional compiled helpers; everything else is in pyproject.toml.

`kvproc.native._native` (kvproc/native/_native.c) is optional: where no C compiler is found the build skips it and
kvproc uses its pure-Python forms (slower hashing and copy planning, same results).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("kvproc.native._native", ["kvproc/native/_native.c", "kvproc/native/_kv_events.c",
                                           "kvproc/native/_digest_chain.c", "kvproc/native/_sketch.c",
                                           "kvproc/native/_prefix_index.c"],
                  depends=["kvproc/native/_native.h"], optional=True, extra_compile_args=["-O3"]),
    ],
)
