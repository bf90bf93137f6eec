"""selfspec's exact speculative decoding as a transformers `custom_generate` loop:
model.generate(**inputs, custom_generate=THIS_FOLDER, trust_remote_code=True[, bundle=THIS_FOLDER])."""

from selfspec.custom_generate import bundle_generate

BUNDLE = "smollm2-135m-instruct"  # the bundle selfspec ships under this name; bundle=FOLDER names another


def generate(model, **kwargs):
    return bundle_generate(model, BUNDLE, **kwargs)
