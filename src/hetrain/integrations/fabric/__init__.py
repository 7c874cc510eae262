"""Lightning Fabric on hetrain's job: the pieces behind `hetrain.integrations.lightning`.

    strategy.py   HetrainStrategy (Fabric's Strategy API), HetrainPrecision (its precision plugin),
                  the checks of Fabric's accelerator, devices and num_nodes, and the drop-in Fabric
    loop.py       Fabric's own loop on hetrain's steps, and fabric.clip_gradients applied in the step
    data.py       the training DataLoader as hetrain's data and the loader of steps Fabric wraps,
                  evaluation loaders split by the plan, the setup order, the wrapped model and optimizer

Import them through `hetrain.integrations.lightning`, which names the pip command when Lightning is
missing; strategy.py and data.py import Lightning directly. loop.py does not: Accelerate's
integration runs its plain loop on PlainLoop too.
"""
