import subprocess
import sys


def test_importing_gen_interface_imports_no_heavy_backend_library():
    code = (
        "import sys, gen_interface, gen_interface.weights, gen_interface.sampling, "
        "gen_interface.decoding, gen_interface.scoring, gen_interface.exact; "
        "print([m for m in ('ray', 'vllm', 'transformers') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
