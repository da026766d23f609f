// Adam with optional AMSGrad and L2 weight decay (torch.optim.Adam semantics).
#include "adam_family.h"

FUSEBOX_PLUGIN(fusebox_plugins::AdamFamily<false>, "adam", "1.0.0",
               "Adam with optional AMSGrad and L2 weight decay (torch.optim.Adam semantics)",
               fusebox::kSupportsStepParam)
