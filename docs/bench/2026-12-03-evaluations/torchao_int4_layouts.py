import torch, warnings
warnings.filterwarnings("ignore")
from pathlib import Path
exec((Path(__file__).parent / "torchao_linear.py").read_text().split("cfgs = ")[0])
from torchao.quantization import Int4WeightOnlyConfig
for fmt in ["plain", "plain_int32", "tile_packed_to_4d", "preshuffled"]:
    try:
        layers = streamed(Int4WeightOnlyConfig(group_size=32, int4_packing_format=fmt), 30)
        print(fmt, curve(layers), flush=True)
    except Exception as e:
        print(fmt, "failed:", type(e).__name__, str(e)[:150], flush=True)
