import torch, sys
from specdecode.models.autotune import streamed_layers, time_rows
for quant in sys.argv[1:]:
    layers = streamed_layers(torch.bfloat16, quant, (8960, 1536))
    print(quant, " ".join(f"{k}:{time_rows(layers, k):.3f}" for k in (1, 2, 4, 8, 9)), flush=True)
    del layers
