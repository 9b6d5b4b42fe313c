"""The other frameworks' API shapes over the same controller: Keras' LossScaleOptimizer, nnabla's
Updater, MindSpore's and TF1's scale managers, and checkpoint import from those systems."""
