// AdamW: Adam with decoupled weight decay (torch.optim.AdamW semantics).
#include "../adam/adam_family.h"

FUSEBOX_PLUGIN(fusebox_plugins::AdamFamily<true>, "adamw", "1.0.0",
               "AdamW: Adam with decoupled weight decay (torch.optim.AdamW semantics)",
               fusebox::kSupportsStepParam)
