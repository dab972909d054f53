"""Weight quantisation: a `QuantizationConfig` chosen from the checkpoint's `quantization_config` (or
`--quantization`), and the linear / MoE methods the layers ask to create, load and apply their weights.

Import-light: ServerArgs reads the flag choices from here; the methods import their kernels on use.

    QUANTIZATION_METHODS   --quantization choices (a bf16 checkpoint quantised at load)
    FP8_ACTIVATION_DTYPES  --fp8-activation-dtype choices
    base_config            QuantizationConfig, LinearMethodBase, FusedMoEMethodBase
    unquant                the model-dtype methods (today's path, the reference)
    fp8                    Fp8Config, Fp8LinearMethod, Fp8MoEMethod (DeepSeek's block-FP8 format)
    apply                  get_quant_config, the construction pass and post-load processing
    weight_bytes           weight bytes per GPU from a model config (the memory plan's input)
"""

QUANTIZATION_METHODS = ["fp8"]
# fp8_e4m3: activations quantised per token in groups of the weight's K block (the checkpoints'
# "dynamic" scheme, W8A8); model_dtype: activations stay in --dtype and meet dequantised weight tiles
# (W8A16: the equivalence reference of the FP8 weights).
FP8_ACTIVATION_DTYPES = ["fp8_e4m3", "model_dtype"]
