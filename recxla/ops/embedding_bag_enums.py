"""The codes the pooled embedding ops take in their int-list arguments (the op schemas of
csrc/embedding_bag.cpp, the constants of csrc/include/recxla/embedding_bag.h): pooling per
table, optimizer kind per table, and the layout of the hparams list."""

# pooling[t]
SUM, MEAN = 0, 1
# optim[t]
NONE, SGD, ADAGRAD, ROWWISE_ADAGRAD = 0, 1, 2, 3
# hparams[NUM_HPARAMS * t : NUM_HPARAMS * (t + 1)] = lr, eps, weight_decay, grad_sign
NUM_HPARAMS = 4
