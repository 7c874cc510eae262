"""Lightning Fabric on hetrain's job: the pieces behind `hetrain.integrations.lightning`.

    strategy.py   HetrainStrategy (Fabric's Strategy API) and HetrainPrecision (its precision plugin)
    data.py       the training DataLoader as hetrain's data, and the loader of steps Fabric wraps

Import them through `hetrain.integrations.lightning`, which names the pip command when Lightning is
missing; these modules import Lightning directly.
"""
