import torch, time, statistics, copy, warnings
warnings.filterwarnings("ignore")
from torchao.quantization import quantize_, Int4WeightOnlyConfig, Int8WeightOnlyConfig, Int8DynamicActivationIntxWeightConfig
torch.manual_seed(0)
def streamed(cfg, n):
    lin = torch.nn.Linear(1536, 8960, bias=False).to(torch.bfloat16)
    if cfg is not None:
        quantize_(lin, cfg)
    return [lin] + [copy.deepcopy(lin) for _ in range(n - 1)]
def curve(layers):
    out = {}
    for k in (1, 2, 4, 8, 9, 16):
        x = torch.randn(k, 1536).to(torch.bfloat16)
        with torch.inference_mode():
            for l in layers: l(x)
            ts = []
            for _ in range(3):
                t = time.perf_counter()
                for l in layers: l(x)
                ts.append((time.perf_counter() - t) / len(layers) * 1e3)
        out[k] = round(statistics.median(ts), 3)
    return out
cfgs = {"bf16 nn.Linear": (None, 10), "Int8WeightOnly": (Int8WeightOnlyConfig(), 20),
        "Int4WeightOnly g32 opaque": (lambda: Int4WeightOnlyConfig(group_size=32, int4_packing_format="opaque"), 30),
        "Int8DynAct Intx(int4) w": (lambda: Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4), 30)}
for name, (cfg, n) in cfgs.items():
    try:
        c = cfg() if callable(cfg) else cfg
        layers = streamed(c, n)
        x = torch.randn(9, 1536).to(torch.bfloat16)
        with torch.inference_mode():
            one = torch.cat([layers[0](x[t:t+1]) for t in range(9)]); inv = torch.equal(layers[0](x), one)
        print(name, curve(layers), "row-invariant(9)", inv, flush=True)
    except Exception as e:
        print(name, "failed:", type(e).__name__, str(e)[:200], flush=True)
