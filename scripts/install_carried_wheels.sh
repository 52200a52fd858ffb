# Source this on a machine without package access (the H200 device): installs Python wheels carried
# in the given folders into /tmp/site and puts them on PYTHONPATH.
#
#   . scripts/install_carried_wheels.sh DIR [DIR...]
#
# Each DIR may hold *.whl files and the parts of *.tar.xz archives (NAME.tar.xz.part-aa, -ab, ...;
# parts may arrive in different device calls, so pass every folder that holds some). An archive is
# an unpacked wheel re-compressed to fit the device tool's 64 MiB carry limit (FA4's
# nvidia-cutlass-dsl-libs-cu13 is 92 MB as a wheel, 64 MB as tar.xz): its parts are joined in name
# order and unpacked into /tmp/site, which is what `pip install --target` would have written.
# FA4 recipe (kernels.md §8): flash-attn-4, nvidia-cutlass-dsl(-libs-base/-core/-cu13),
# quack-kernels, apache-tvm-ffi, torch-c-dlpack-ext; the cutlass DSL also needs
# /tmp/site/nvidia_cutlass_dsl/dsl_packages on the path (a --target install skips its .pth).
SITE=${SITE:-/tmp/site}
mkdir -p "$SITE"
_whls=$(for d in "$@"; do ls "$d"/*.whl 2>/dev/null; done)
if [ -n "$_whls" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" $_whls \
    || echo "install_carried_wheels: pip install failed" >&2
fi
for _name in $(for d in "$@"; do ls "$d" 2>/dev/null; done | sed -n 's/\(.*\.tar\.xz\)\.part-.*/\1/p' | sort -u); do
  cat $(for d in "$@"; do ls "$d"/"$_name".part-* 2>/dev/null; done | awk -F/ '{print $NF "\t" $0}' | sort | cut -f2) \
    | xz -d | tar x -C "$SITE" \
    || echo "install_carried_wheels: could not unpack $_name" >&2
done
export PYTHONPATH="$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
unset _whls _name
