{
  description = "moe-dispatch: pure-Triton Mixture-of-Experts kernels for the Hugging Face kernel hub";

  inputs = {
    kernel-builder.url = "github:huggingface/kernels";
  };

  outputs =
    { self, kernel-builder }:
    kernel-builder.lib.genKernelFlakeOutputs {
      inherit self;
      path = ./.;
    };
}
