"""`keep_freed_memory` (serving.py): glibc takes both malloc settings; elsewhere nothing changes."""

import platform

from asyncrl.inference.serving import keep_freed_memory


def test_glibc_takes_the_malloc_settings():
    assert keep_freed_memory() is (platform.libc_ver()[0] == "glibc")
