# Re-implementation of the gfx9 (CDNA1-3) register-placement rules of
# ROCm/amd_matrix_instruction_calculator (InstCalcGfx9.__get_input_reg_lanes /
# __get_output_reg_lanes / _get_cbsz_abid_transformed_block / _get_blgp_transformed_lane),
# used to check the closed-form layouts claimed in notes/amd-mfma.md.
import math
def inp(M,K,B,i,k,b,bits):
    e = int(64/(M*B)); e = int(K/e)           # elements in contiguous gprs
    slot = k % e                                # 16-bit slot index = vector element index
    lane = b*M + int(k/e)*M*B + i
    return slot, lane
def out(M,N,i,j,b):
    mpr = int(64/N); mh = 4; bpr = math.ceil(64/int((N*M)/mh))
    reg = b*int((M*N)/64) + int(i/(mh*mpr))*mh + i % mh
    lane = (b % bpr)*N + (int(i/mh) % mpr)*bpr*N + j
    return reg, lane
def cbsz_abid(block, cbsz, abid):
    n = 2**cbsz; return int(block/n)*n + abid
def blgp_lane(l, blgp):
    if blgp==1: return l%32
    if blgp==2: return l+32 if l<32 else l
    if blgp==3: return (l+16)%64
    if blgp==4: return l%16
    if blgp==5: return l+16 if l<16 else (l-32 if l>=48 else (l-16 if l>=32 else l))
    if blgp==6: return l-16 if l>=48 else (l+32 if l<16 else (l+16 if l<32 else l))
    if blgp==7: return l + (3-int(l/16))*16
    return l
ok=True
# 16x16x16 (f16 and bf16_1k identical): M=N=K=16, B=1
for i in range(16):
  for k in range(16):
    s,l = inp(16,16,1,i,k,0,16)
    ok &= (l%16==i and 4*(l//16)+s==k and s==k%4)
for i in range(16):
  for j in range(16):
    r,l = out(16,16,i,j,0)
    ok &= (l%16==j and 4*(l//16)+r==i)
print("16x16x16 claim (A: lane l, elem r = A[l%16][4*(l/16)+r]; D: lane l, reg r = D[4*(l/16)+r][l%16]):", ok)
ok=True
# 4x4x4_16B: M=N=K=4, B=16
for b in range(16):
  for i in range(4):
    for k in range(4):
      s,l = inp(4,4,16,i,k,b,16)
      ok &= (l==4*b+i and s==k)
    for j in range(4):
      r,l = out(4,4,i,j,b)
      ok &= (r==i and l==4*b+j)
print("4x4x4_16B claim (A_b[i][k] at lane 4b+i elem k; D_b[i][j] at lane 4b+j reg i):", ok)
# README spot checks (CDNA2 v_mfma_f32_4x4x4f16): A[1][2].B4 = v1{17}.[15:0]; v2{33} = D[2][1].B8
s,l = inp(4,4,16,1,2,4,16); print("A[1][2].B4 -> slot",s,"(v%d.%s)"%(s//2,["lo","hi"][s%2]),"lane",l)
r,l = out(4,4,2,1,8); print("D[2][1].B8 -> reg",r,"lane",l)
# CBSZ/ABID: with cbsz=4, abid=x every block reads A from block x (lanes 4x..4x+3)
print("cbsz=4 abid=5 source block for blocks 0..15:", [cbsz_abid(b,4,5) for b in range(16)])
print("cbsz=2 abid=1 source blocks:", [cbsz_abid(b,2,1) for b in range(16)])
# BLGP: which B lane each lane reads; in 4x4x4 block b = lane//4 -> source block
for g in range(8):
    print("blgp=%d: block b reads B of block"%g, [blgp_lane(4*b,g)//4 for b in range(16)])
