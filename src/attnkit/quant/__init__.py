"""KV-cache quantization: KIVI's quantizer (:mod:`attnkit.quant.kivi`) and the layer storage that holds a cache
method's entries as its codes (:mod:`attnkit.quant.layer`). The ``kivi`` method (:mod:`attnkit.methods.kivi`)
puts any cache method on that storage."""
