"""What the built-in image handlers share: decode each request's image, transform it, batch it.

Pillow decodes; torch does the arithmetic (resize and crop as torchvision's ``Resize`` and
``CenterCrop`` do on PIL images, then to a float CHW tensor and normalise), so torchvision is not
needed. A request whose image cannot be read gets a 400 of its own; the rest of the batch runs.
``/explanations`` answers captum's integrated gradients, as TorchServe's vision handlers do.
Standard library only at import time: Pillow and torch are imported when the handler loads,
captum by the first explanation.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

from .base_handler import BadInput, BaseHandler, request_input
from .insights import IG_STEPS, captum_attr, checked_target

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class VisionHandler(BaseHandler):
    """Base of the image handlers. The transform is set by class attributes, so a subclass (or
    the model config's ``handler:`` section) changes sizes without rewriting preprocess."""

    resize_size = 0  # shorter side in pixels; 0 keeps the image's size
    crop_size = 0  # side of the centre square; 0 does not crop
    mean: tuple[float, ...] = ()  # per channel; empty: no normalisation
    std: tuple[float, ...] = ()
    image_mode = "RGB"
    handler_options: tuple[str, ...] = ("resize_size", "crop_size", "mean", "std")

    def initialize(self, context: Any) -> None:
        """Load the model; lift Pillow's decompression-bomb limit only when the server's
        ``limit_max_image_pixels`` is false, as TorchServe does."""
        super().initialize(context)
        if not context.system_properties.get("limit_max_image_pixels", True):
            from PIL import Image

            Image.MAX_IMAGE_PIXELS = None

    @property
    def image_processing(self) -> Any:
        """The PIL image -> tensor step, which TorchServe handlers set (a torchvision
        ``Compose``) or call from their own ``preprocess``: the handler's own when it sets one,
        else :meth:`transform` after conversion to ``image_mode``."""
        own = self.__dict__.get("_image_processing")
        return own if own is not None else self._builtin_processing

    @image_processing.setter
    def image_processing(self, value: Any) -> None:
        self.__dict__["_image_processing"] = value

    def _builtin_processing(self, image: Any) -> Any:
        if image.mode != self.image_mode:
            image = image.convert(self.image_mode)
        return self.transform(image)

    def _has_own_processing(self) -> bool:
        processing = self.image_processing
        builtin = getattr(processing, "__func__", None) is VisionHandler._builtin_processing
        return processing is not None and not builtin

    @property
    def ig(self) -> Any:
        """captum's ``IntegratedGradients`` over the model. TorchServe builds it in
        ``initialize``; here the first explanation does, so predictions never need captum. A
        subclass that sets its own keeps it."""
        ig = self.__dict__.get("ig")
        if ig is None:
            attr = captum_attr(type(self).__name__)
            ig = self.__dict__["ig"] = attr.IntegratedGradients(self.model)
        return ig

    @ig.setter
    def ig(self, value: Any) -> None:
        self.__dict__["ig"] = value

    def get_insights(self, tensor_data: Any, raw_data: Any, target: Any = 0) -> Any:
        """TorchServe's answer: per request, the integrated gradients (15 steps from an all-zero
        input) of the ``target`` class's score with respect to each input value, a nested
        ``[channel][row][column]`` list shaped as the preprocessed image."""
        import torch

        ig = self.ig
        first = tensor_data[0][None] if isinstance(tensor_data, list) else tensor_data[:1]
        with torch.no_grad():
            target = checked_target(target, int(self.model(first).shape[-1]))
        if not isinstance(tensor_data, list):
            return ig.attribute(tensor_data, target=target, n_steps=IG_STEPS).tolist()
        # Sizes differ (no crop): one image at a time, as inference does.
        return [
            ig.attribute(image[None], target=target, n_steps=IG_STEPS)[0].tolist()
            for image in tensor_data
        ]

    def preprocess(self, data: list[Any]) -> Any:
        """Decode and transform each request's image; stack them when they share a shape (a list
        of tensors otherwise). Unreadable images are rejected one by one."""
        import torch

        images = []
        for idx, row in enumerate(data):
            try:
                images.append(self.image_tensor(request_input(row)))
            except BadInput as exc:
                self.reject(idx, str(exc))
        if not images:
            return None
        if all(image.shape == images[0].shape for image in images):
            return torch.stack(images).to(self.device)
        return [image.to(self.device) for image in images]

    def image_tensor(self, value: Any) -> Any:
        """One request's input as a CHW float tensor: image bytes, base64 text, or a nested list
        of numbers taken as the tensor itself."""
        import torch

        if isinstance(value, list):
            try:
                return torch.as_tensor(value, dtype=torch.float32)
            except (TypeError, ValueError) as exc:
                raise BadInput(f"a list input must be a nested list of numbers: {exc}") from None
        if self._has_own_processing():
            # As TorchServe: the handler's transform gets the image as opened, in its own mode
            # (a grayscale MNIST digit stays one channel).
            return self.image_processing(decode_image(value, None))
        return self.transform(decode_image(value, self.image_mode))

    def transform(self, image: Any) -> Any:
        """Resize, centre-crop, to tensor, normalise (the steps whose size is set)."""
        if self.resize_size:
            image = resize_shorter_side(image, self.resize_size)
        if self.crop_size:
            image = center_crop(image, self.crop_size)
        tensor = to_tensor(image)
        if self.mean:
            tensor = normalize(tensor, self.mean, self.std)
        return tensor


def decode_image(value: Any, mode: str | None = "RGB") -> Any:
    """A PIL image from raw bytes or base64 text (a ``data:`` URL prefix is allowed), converted
    to ``mode`` (None keeps the file's own)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, str):
        text = value.split(",", 1)[1] if value.startswith("data:") else value
        try:
            value = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise BadInput(
                "the image sent as text is not valid base64; send the image file's bytes as the "
                "request body, or base64 of them"
            ) from None
    if not isinstance(value, (bytes, bytearray)):
        raise BadInput(
            f"expected an image (file bytes or base64 text), found {type(value).__name__}"
        )
    if not value:
        raise BadInput("the request has no image: its body is empty")
    try:
        image = Image.open(io.BytesIO(value))
        if mode is None:
            image.load()  # decode now, inside this error handling; the bytes stay in memory
            return image
        with image:
            return image.convert(mode)
    except Image.DecompressionBombError as exc:
        raise BadInput(f"image refused: {exc}") from None
    except UnidentifiedImageError:
        raise BadInput(
            f"cannot read the request's image: its {len(value)} bytes (starting {value[:8]!r}) "
            f"are not in an image format Pillow knows"
        ) from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise BadInput(f"cannot read the request's image ({len(value)} bytes): {exc}") from None


def resize_shorter_side(image: Any, size: int) -> Any:
    """Scale so the shorter side is ``size`` (bilinear, antialiased), as torchvision's Resize."""
    from PIL import Image

    width, height = image.size
    short, long = (width, height) if width <= height else (height, width)
    if short == size:
        return image
    new_short, new_long = size, int(size * long / short)
    new_size = (new_short, new_long) if width <= height else (new_long, new_short)
    return image.resize(new_size, getattr(Image, "Resampling", Image).BILINEAR)


def center_crop(image: Any, size: int) -> Any:
    """The centred ``size`` x ``size`` square (zero-padded where the image is smaller)."""
    width, height = image.size
    top = round((height - size) / 2.0)
    left = round((width - size) / 2.0)
    return image.crop((left, top, left + size, top + size))


def to_tensor(image: Any) -> Any:
    """A PIL image as a float CHW tensor in [0, 1]."""
    import torch

    channels = len(image.getbands())
    width, height = image.size
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    return pixels.reshape(height, width, channels).permute(2, 0, 1).float().div(255)


def normalize(tensor: Any, mean: tuple[float, ...], std: tuple[float, ...]) -> Any:
    """``(tensor - mean) / std`` per channel."""
    import torch

    mean_t = torch.tensor(mean, dtype=tensor.dtype).reshape(-1, 1, 1)
    std_t = torch.tensor(std, dtype=tensor.dtype).reshape(-1, 1, 1)
    return (tensor - mean_t) / std_t
