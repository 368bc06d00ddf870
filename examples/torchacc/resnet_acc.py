"""ResNet-50 accelerated in one process: the TorchAcc quick start with functacc.

python examples/torchacc/resnet_acc.py
"""

import time

import torch
from _sizes import resnet, sizes

import functacc as torchacc

args = sizes()
batch_size = args.batch_size
log_steps = args.log_steps
inputs = torch.randn(args.samples, 3, args.image_size, args.image_size)
labels = torch.randint(0, 100, (args.samples,))
dataset = torch.utils.data.TensorDataset(inputs, labels)
train_loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True)

model = resnet(args.arch)

model, train_loader = torchacc.accelerate(model, train_loader)
device = model.device
criterion = torch.nn.CrossEntropyLoss()
optimizer = torch.optim.AdamW(model.parameters(), lr=0.001)

for epoch in range(args.epochs):
    model.train()
    start_time = time.time()
    for i, (inputs, labels) in enumerate(train_loader, 1):
        optimizer.zero_grad()
        outputs = model(inputs)
        loss = criterion(outputs, labels)
        loss.backward()
        optimizer.step()
        if i % log_steps == 0:
            iteration_time = time.time() - start_time
            throughputs = batch_size * log_steps / iteration_time
            print(
                f"Epoch: {epoch}, Step: {i}, Loss: {loss:.4f}, Throughputs: {throughputs:.4f} samples/s"
            )
            start_time = time.time()
