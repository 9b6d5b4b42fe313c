"""Other frameworks' APIs for loss scaling, over the same controller: Keras' LossScaleOptimizer,
nnabla's Updater, MindSpore's and TF1's scale managers, and checkpoint import from Megatron-LM,
DeepSpeed and apex (``tritonscale.from_megatron``, ...)."""
