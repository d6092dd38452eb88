"""Home of the op modules prebuilt by ``LF_BUILD_OPS=1 pip install .`` (empty in a JIT install)."""
