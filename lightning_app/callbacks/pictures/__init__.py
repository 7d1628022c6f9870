"""TensorBoard pictures: the callback (what is kept during validation) and its drawing (on a background thread)."""
from lightning_app.callbacks.pictures.callback import KINDS, TensorBoardPictures, picture_callbacks

__all__ = ["KINDS", "TensorBoardPictures", "picture_callbacks"]
