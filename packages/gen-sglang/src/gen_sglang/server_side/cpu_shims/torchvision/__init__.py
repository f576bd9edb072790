"""Import-only stand-in for torchvision, which PyPI builds break beside torch 2.13 on the CPU
(``operator torchvision::nms does not exist``). SGLang's multimodal configs and transformers'
image utilities import these names; a text model never calls them."""

__version__ = "0.28.0"  # the torchvision of torch 2.13
