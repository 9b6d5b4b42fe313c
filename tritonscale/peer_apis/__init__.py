"""The peers' APIs for loss scaling, over the same controller and importing none of the peers:
Keras' LossScaleOptimizer, nnabla's Updater, MindSpore's and TF1's scale managers, and checkpoint
import from Megatron-LM, DeepSpeed and apex (``tritonscale.from_megatron``, ...). ``integrations/``
is the other direction: plug-ins that run inside a framework (Lightning, Accelerate, timm,
mmengine) and import it."""
