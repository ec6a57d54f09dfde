"""Low-level I/O shared by every room: atomic, pickle-free files; devices; the run-directory format."""

DTYPES = ("float32", "bfloat16", "float16")  # the floating-point types a run may train or decode in
